"""Text tests' shared constants (a ChatML template)."""

from __future__ import annotations

CHATML = """{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}\
{% endgeneration %}{{ '\\n' }}
{%- else -%}
{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}
{%- endif -%}
{%- endfor -%}"""

