"""Images sized and normalised as the encoder that reads them expects: a CLIP or SigLIP
tower's image processor (held against transformers' own), native resolution for
dtdsl's ViT."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from dtdsl.data.images import ImagePolicy, normalize
from dtdsl.ir.modal import CLIP_MEAN


def _tower(family: str, image_size: int, path, patch: int = 8):
    return SimpleNamespace(arch=SimpleNamespace(patch=patch, image_size=image_size),
                           hf=SimpleNamespace(family=family, path=str(path)))


def _image(w: int, h: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3),
                                                                dtype=np.uint8))


@pytest.mark.parametrize("family", ["clip", "siglip"])
@pytest.mark.parametrize("size", [(60, 40), (40, 90), (32, 32)])
def test_towers_see_what_their_image_processor_gives(family, size, tmp_path):
    """The tower's default processing equals transformers' image processor (PIL) for it:
    CLIP's shortest-edge resize and centre crop with OpenAI's mean and std, SigLIP's
    square resize with 0.5 and 0.5."""
    from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

    policy = ImagePolicy.for_encoder(_tower(family, 32, tmp_path))
    img = _image(*size)
    ours = normalize(policy.resize(img), policy.mean, policy.std).numpy()
    if family == "clip":
        theirs = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                       crop_size={"height": 32, "width": 32})
    else:
        theirs = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    want = theirs(images=img, return_tensors="np")["pixel_values"][0]
    assert ours.shape == want.shape == (3, 32, 32)
    np.testing.assert_allclose(ours, want, atol=1e-5)
    assert policy.shape(*size) == (32, 32)


def test_a_preprocessor_config_is_read(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 48}, "crop_size": {"height": 40, "width": 40},
        "do_center_crop": True, "resample": 2, "image_mean": [0.1, 0.2, 0.3],
        "image_std": [0.5, 0.5, 0.5]}))
    policy = ImagePolicy.for_encoder(_tower("clip", 32, tmp_path))
    assert policy.size == (40, 40) and policy.shortest_edge == 48
    assert policy.resample == "bilinear" and policy.mean == (0.1, 0.2, 0.3)
    assert policy.resize(_image(100, 60)).shape == (3, 40, 40)
    assert ImagePolicy.for_encoder(_tower("clip", 32, tmp_path / "none")).mean == CLIP_MEAN


def test_dtdsls_vit_reads_native_resolution_under_a_patch_budget():
    vit = SimpleNamespace(arch=SimpleNamespace(patch=8, image_size=None), hf=None)
    policy = ImagePolicy.for_encoder(vit, max_patches=20)
    assert policy.shape(64, 32) == (24, 48) and policy.size is None  # 8x4 -> 6x3 patches
    assert policy.resize(_image(64, 32)).shape == (3, 24, 48)
    x = normalize(np.full((3, 2, 2), 255, dtype=np.uint8))
    assert x.dtype.is_floating_point and float(x.min()) == float(x.max()) == 1.0


def _encoded(img, fmt: str):
    import io

    from dtdsl.data.shard_format import EncodedImage

    buf = io.BytesIO()
    img.save(buf, fmt)
    return EncodedImage(format=fmt.lower(), data=buf.getvalue(), width=img.width,
                        height=img.height)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P-transparent", "L", "CMYK"])
def test_images_of_other_modes_decode_as_transformers_converts_them(mode, tmp_path):
    # transformers' processors lay an image with alpha over white (convert_to_rgb): a
    # transparent pixel is white, not the colour stored under it.
    import io

    from PIL import Image
    from transformers import CLIPImageProcessorPil

    from dtdsl.data.decode import Decoder

    rng = np.random.default_rng(5)
    rgba = rng.integers(0, 255, (24, 36, 4), dtype=np.uint8)
    rgba[:8, :, 3] = 0                                   # a fully transparent band
    img = Image.fromarray(rgba, "RGBA")
    if mode == "LA":
        img = img.convert("LA")
    elif mode == "P-transparent":
        img = img.convert("RGB").quantize(16)
        img.info["transparency"] = 3
    elif mode in ("L", "CMYK"):
        img = img.convert(mode)
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    data = _encoded(img, fmt)
    decoded = Decoder._open(None, SimpleNamespace(key="k"), data)
    assert decoded.mode == "RGB"
    policy = ImagePolicy.for_encoder(_tower("clip", 32, tmp_path))
    ours = normalize(policy.resize(decoded), policy.mean, policy.std).numpy()
    theirs = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32})
    want = theirs(images=Image.open(io.BytesIO(data.data)),
                  return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(ours, want, atol=1e-5)
    if mode == "RGBA":
        assert np.asarray(decoded)[:8].min() == 255      # white where it is transparent


def test_only_jpeg_png_and_webp_are_opened(tmp_path):
    # Pillow picks a plugin by the bytes: a PostScript file named .jpg would be handed
    # to Ghostscript. A dataset's image is one of three formats or unreadable.
    import io

    from PIL import Image, UnidentifiedImageError

    from dtdsl.data.shard_format import open_image

    for fmt in ("EPS", "BMP", "GIF", "TIFF", "PPM"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, fmt)
        with pytest.raises(UnidentifiedImageError):
            open_image(io.BytesIO(buf.getvalue()))
    for fmt in ("JPEG", "PNG", "WEBP"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, fmt)
        with open_image(io.BytesIO(buf.getvalue())) as img:
            assert img.format == fmt
