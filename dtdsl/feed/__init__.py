"""dtdsl.feed: how CPU preprocessing workers stream samples to trainer ranks.

``dtdsl.feed.wire`` is the transport: pyzmq multipart messages made of a msgpack header and
raw tensor buffers (no pickle), each authenticated with the job's HMAC secret, on sockets
bound only to the exact addresses the plan names.
"""
