"""The tokenized cache stores image references, not pixels: for every image family, the pixel values and grids the
target is fed are those the family's processing (`ImageTokens.process`) made of the conversation's images when the data
was tokenized (bit for bit, also for a sequence that kept some of its images), the cache is a small fraction of the
pixels' size, and a changed image rebuilds the cache (or, changed under a loaded one, is an error naming it)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer.config import load_config
from dflash_trainer.data.config import DataSourceConfig
from dflash_trainer.data.masks import end_of_turn_marker
from dflash_trainer.data.prepare import prepare_data
from dflash_trainer.data.tiny_tokenizer import build_tiny_image_tokens, build_tiny_tokenizer
from dflash_trainer.data.sources import load_source
from dflash_trainer.data.tokenize_pool import TokenizeSettings, tokenize_one
from dflash_trainer.data.vision import images_of
from dflash_trainer.errors import DataError
from dflash_trainer.target.capture import prepare_inputs
from dflash_trainer.transport.wire import WireSpec, allocate
from tests.test_vlm_target import REPLY, data_url, image_conversations, png, write_rows

FAMILIES = {"tiny-qwen3-vl": "qwen3-vl", "tiny-gemma3-vl": "gemma3", "tiny-gemma4-vl": "gemma4",
            "tiny-llama4-vl": "llama4"}
"""Preset -> its tiny tokenizer and processor (`tiny:<family>`): one of each image family."""


def two_turns(first: str, second: list[str]) -> dict:
    """A conversation with an image in its first user turn and `second` in its second."""
    image = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    return {"messages": [
        {"role": "user", "content": [image(first), {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": [*map(image, second), {"type": "text", "text": "And these two?"}]},
        {"role": "assistant", "content": REPLY}]}


def fed_pixels_reference(images, conversation, grid: torch.Tensor) -> torch.Tensor:
    """What a cache of pixels held and fed for a sequence: the family's processing of all of its conversation's
    images (as tokenizing runs it), the rows of the images the sequence kept; their grids are `grid`'s."""
    processed = images.process(images_of(conversation.messages))
    assert torch.equal(processed.image_grid_thw[:len(grid)], grid)
    return processed.pixel_values[: int(grid.prod(-1).sum())]


def config(folder, max_length: int, preset: str):
    return load_config(None, [f"target.random_init={preset}", f"target.tokenizer=tiny:{FAMILIES[preset]}",
                              f"data.path={folder / 'train.jsonl'}", f"data.cache_dir={folder / 'cache'}",
                              "data.num_eval_conversations=0", f"data.max_length={max_length}",
                              f"pipeline.token_budget={max(max_length, 512)}", "data.num_workers=1"])


def fed_to_target(dataset, ids) -> torch.Tensor:
    """The pixel values of a job of these sequences as the target's forward gets them."""
    sequences = [dataset[i] for i in ids]
    spec = WireSpec(token_budget=sum(s.num_tokens for s in sequences), max_seqs=len(ids), num_taps=1, hidden=8,
                    dtype=torch.float32, has_last_hidden=False)
    return prepare_inputs(sequences, allocate(spec, "cpu")).pixel_values


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_the_target_is_fed_the_tokenized_pixels_from_a_cache_of_image_references(tmp_path, preset):
    rows = image_conversations(tmp_path, 5)  # file and data URL images of several sizes
    png(tmp_path / "images" / "big.png", 128, 128, 7)
    png(tmp_path / "images" / "wide.png", 64, 128, 8)
    rows.append(two_turns("images/big.png", ["images/wide.png", data_url(128, 96, 9)]))
    source = write_rows(tmp_path / "train.jsonl", rows)
    # a max_length that cuts the two-turn row before its last image (which is then left out whole)
    (long,) = load_source(DataSourceConfig(path=str(source)), images=True).conversations[-1:]
    tokenizer, images = build_tiny_tokenizer(FAMILIES[preset]), build_tiny_image_tokens(FAMILIES[preset])
    whole = tokenize_one(long, tokenizer, TokenizeSettings(
        thinking=False, end_of_turn=end_of_turn_marker(tokenizer, thinking=False), max_length=4096, min_supervised=4,
        images=images))
    last_tokens = int(images.process(images_of(long.messages)).token_counts[-1])
    last_image = int(torch.nonzero(whole.input_ids == images.image_token_id)[-last_tokens])  # its first image token
    max_length = last_image + 3

    prepared = prepare_data(config(tmp_path, max_length, preset), tmp_path / "run", write_files=False)
    train = prepared.train
    conversations = {c.source_index: c for c in load_source(DataSourceConfig(path=str(source)), images=True).conversations}
    assert len(train) == 6 and not prepared.summary.cache_hit
    grids = [train.images.image_grid_thw[int(train.images.image_offsets[i]):int(train.images.image_offsets[i + 1])]
             for i in range(len(train))]
    cut = [i for i in range(len(train)) if int(train.source_index[i]) == 5]
    assert [len(grids[i]) for i in cut] == [2]  # the long row kept 2 of its 3 images

    # the pixel values fed to the target, read through a cache hit: bit-identical to the float32 cache's
    again = prepare_data(config(tmp_path, max_length, preset), tmp_path / "run", write_files=False)
    assert again.summary.cache_hit and again.summary.content_sha256 == prepared.summary.content_sha256
    old_layout_bytes = 0
    for ids in ([0, 1, 2], [3, 4, 5], cut):  # two jobs of all sequences, and the cut one alone
        reference = torch.cat([fed_pixels_reference(images, conversations[int(again.train.source_index[i])],
                                                    grids[i]) for i in ids])
        assert torch.equal(fed_to_target(again.train, ids), reference)
        old_layout_bytes += reference.numel() * reference.element_size() if ids != cut else 0

    # the cache holds references: no pixels; a file by its path and digest, a data URL whole (it is the image)
    stored = load_file(str(tmp_path / "cache" / prepared.summary.cache_path.split("/")[-1] / "data.safetensors"))
    assert "pixel_values" not in stored and {"image_sources", "image_grid_thw", "image_offsets"} <= set(stored)
    sources = bytes(stored["image_sources"].tolist())
    assert str(tmp_path / "images" / "1.png").encode() in sources and sources.count(b"data:image/png;base64,") == 3
    data_urls = {r.url for r in train.images.refs if r.url.startswith("data:")}
    assert int(train.images.image_offsets[-1]) == 7 and len(sources) < sum(map(len, data_urls)) + 250 * 4
    if FAMILIES[preset] == "qwen3-vl":  # its tiny processor keeps the images' size: 983 KB of patches, 34 KB of cache
        assert sum(t.numel() * t.element_size() for t in stored.values()) * 10 < old_layout_bytes

    # an image file that changes under a loaded dataset is an error naming it, never other pixels
    first_file = next(i for i in range(len(train)) if not train.images.refs[int(train.images.image_offsets[i])]
                      .url.startswith("data:"))
    changed = train.images.refs[int(train.images.image_offsets[first_file])].url
    png(changed, 32, 48, 1234)
    with pytest.raises(DataError, match=rf"training sequence {first_file}: .*{changed}.*changed since"):
        again.train[first_file]
    # ... and rebuilds the cache when the data is prepared again, with the new pixels (and a new content digest)
    rebuilt = prepare_data(config(tmp_path, max_length, preset), tmp_path / "run", write_files=False)
    assert not rebuilt.summary.cache_hit and rebuilt.summary.content_sha256 != prepared.summary.content_sha256
    i = next(k for k in range(len(rebuilt.train)) if rebuilt.train.images.refs[
        int(rebuilt.train.images.image_offsets[k])].url == changed)
    now = load_source(DataSourceConfig(path=str(source)), images=True).conversations  # the image's new digest
    reference = fed_pixels_reference(images, now[int(rebuilt.train.source_index[i])], rebuilt.train[i].image_grid_thw)
    assert torch.equal(fed_to_target(rebuilt.train, [i]), reference)


def test_the_image_storage_bench_runs_and_checks_the_bits(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from dflash_trainer.data.tiny_tokenizer import TINY_IMAGE_TOKENS

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "host" / "image_storage.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted((r["processor"], r["image"]) for r in result["rows"]) == sorted(
        (f"tiny {family}", f"96x128 {kind}") for family in TINY_IMAGE_TOKENS for kind in ("PNG", "JPEG"))
    assert all(r["same_bits"] and r["read_ms"] > 0 and r["reference_bytes"] * 100 < r["float32_patch_bytes"]
               for r in result["rows"])
    assert len(list(tmp_path.glob("*-host-image_storage.json"))) == 1


def test_worker_processes_hand_back_the_image_references_one_process_makes(tmp_path):
    from dflash_trainer.data.tokenized import tokenize_all

    source = write_rows(tmp_path / "train.jsonl", image_conversations(tmp_path, 6))
    chats = list(load_source(DataSourceConfig(path=str(source)), images=True).conversations)
    tokenizer, images = build_tiny_tokenizer("qwen3-vl"), build_tiny_image_tokens("qwen3-vl")
    kwargs = dict(thinking=False, max_length=512, min_supervised=4, images=images)
    one = tokenize_all(chats, tokenizer, **kwargs).dataset
    many = tokenize_all(chats, tokenizer, num_workers=2, parallel_min_s=0.0, probe=2, **kwargs).dataset
    assert len(one) == len(many) == 6 and one.content_sha256() == many.content_sha256()
    assert one.images.refs == many.images.refs and len(one.images.refs) == 6
    assert all(torch.equal(one[i].pixel_values, many[i].pixel_values) for i in range(6))
