"""Batched decoding of image prompts on an image-text target (issue 63): the prefill runs the image-text model with the
images at their M-RoPE positions, each row's later text continues from its own `rope_delta`, and the drafter's context
gets the taps training captures. Speculative decoding stays lossless against HF's own `generate` of each prompt alone
with its images; plain batched decoding equals it too."""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.data.tiny_tokenizer import build_tiny_image_tokens, build_tiny_tokenizer
from dflash_trainer.data.types import TokenizedSequence
from dflash_trainer.eval.batched import ContextUpdate, decode_batch
from dflash_trainer.eval.image_prompts import encode_image_prompt, message_rows
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import load_target
from tests.drafter_helpers import single_thread  # noqa: F401 (autouse fixture)
from tests.test_family_decode import OracleProposer
from tests.test_target_capture import capture
from tests.test_vlm_target import IMAGE_PAD, data_url, png

NEW = 20


class TapRecordingOracle(OracleProposer):
    """The oracle, also asking for taps and keeping each update it is told."""

    needs_taps = True

    def __init__(self, sequences, vocab):
        super().__init__(sequences, vocab)
        self.updates: list[ContextUpdate] = []

    def observe(self, update: ContextUpdate) -> None:
        self.updates.append(update)


@pytest.fixture(scope="module")
def vl_target():
    return load_target(TargetConfig(random_init="tiny-qwen3-vl", dtype="float32", compile=False,
                                    attn_implementation="eager"), "cpu", seed=0)


@pytest.fixture(scope="module")
def image_prompts(tmp_path_factory):
    """Four prompts: one image, two images, text only, one image mid-turn; ids and images as eval encodes them."""
    folder = tmp_path_factory.mktemp("images")
    tokenizer = build_tiny_tokenizer("qwen3-vl")
    images = build_tiny_image_tokens("qwen3-vl")

    def image(url):
        return {"type": "image_url", "image_url": {"url": url}}

    turns = [
        [image(str(png(folder / "a.png", 40, 70, 0))), {"type": "text", "text": "What is in this picture?"}],
        [image("b.png"), image(data_url(50, 40, 2)), {"type": "text", "text": "Compare the two."}],
        "Say something about noise.",
        [{"type": "text", "text": "Look:"}, image(data_url(64, 64, 3)), {"type": "text", "text": "and describe it."}],
    ]
    png(folder / "b.png", 64, 96, 1)
    encoded = [encode_image_prompt(tokenizer, message_rows([{"role": "user", "content": t}], folder), images,
                                   thinking=False, max_prompt_tokens=4096) for t in turns]
    return [ids for ids, _ in encoded], [i for _, i in encoded]


def hf_generate(target, ids, images):
    """HF's own greedy `generate` of one prompt with its images: exactly NEW tokens (no stop)."""
    kwargs = {}
    if images is not None:
        kwargs = {"pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw,
                  "mm_token_type_ids": (ids[None] == IMAGE_PAD).int()}
    target.model.rope_deltas = None
    out = target.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                          max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None, pad_token_id=0, **kwargs)
    target.model.rope_deltas = None
    return out[0, len(ids):].tolist()


def test_image_prompts_decode_losslessly_with_their_images(vl_target, image_prompts):
    prompts, images = image_prompts
    assert [i is None for i in images] == [False, False, True, False] and len(images[1].image_grid_thw) == 2
    alone = [hf_generate(vl_target, ids, imgs) for ids, imgs in zip(prompts, images)]
    # the images matter: the same ids without them decode otherwise
    assert hf_generate(vl_target, prompts[0], None) != alone[0]

    assert_decodes_as_alone(vl_target, prompts, images, alone)


def assert_decodes_as_alone(target, prompts, images, alone):
    """Left-padded rows of `prompts` with their `images` decode as `alone` (each prompt's own greedy continuation),
    plainly and speculatively (an oracle right for a different number of tokens each step), and the drafter's context
    at the prefill is the taps training captures (after a deepstack addition, the next layer's input), at slot
    positions 0..L-1 of each row."""
    plain = decode_batch(target, prompts, images=images, max_new_tokens=NEW, stop_token_ids=[])
    assert [r.output_ids for r in plain] == alone

    sequences = [p.tolist() + a for p, a in zip(prompts, alone)]
    taps = [0, 2, 4]
    proposer = TapRecordingOracle(sequences, vocab=target.config.get_text_config().vocab_size)
    out = decode_batch(target, prompts, images=images, proposer=proposer, block_size=5, tap_layer_ids=taps,
                       max_new_tokens=NEW, stop_token_ids=[])
    assert [r.output_ids for r in out] == alone
    lengths = [n for r in out for n in r.acceptance_lengths]
    assert max(lengths) == 5 and min(lengths) == 1 and len(set(lengths)) > 2  # whole, none and partial blocks

    prefill = proposer.updates[0]
    sequences = [TokenizedSequence(input_ids=ids, loss_mask=torch.zeros_like(ids, dtype=torch.bool),
                                   pixel_values=None if i is None else i.pixel_values,
                                   image_grid_thw=None if i is None else i.image_grid_thw)
                 for ids, i in zip(prompts, images)]
    _, captured = capture(target, sequences, taps, token_budget=sum(len(p) for p in prompts))
    start = 0
    for row, ids in enumerate(prompts):
        valid = prefill.valid[row]
        assert prefill.tokens[row, valid].tolist() == ids.tolist()
        assert prefill.positions[row, valid].tolist() == list(range(len(ids)))
        torch.testing.assert_close(prefill.taps[row, valid], captured.taps[start : start + len(ids)], atol=1e-4,
                                   rtol=1e-4)
        start += len(ids)


def test_a_long_image_prompt_is_cut_before_an_image_never_through_it(image_prompts, tmp_path, caplog):
    tokenizer = build_tiny_tokenizer("qwen3-vl")
    images = build_tiny_image_tokens("qwen3-vl")
    messages = message_rows([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(40, 40, 5)}},
        {"type": "image_url", "image_url": {"url": data_url(64, 64, 6)}},
        {"type": "text", "text": "Which is larger?"}]}], tmp_path)
    whole, both = encode_image_prompt(tokenizer, messages, images, thinking=False, max_prompt_tokens=4096)
    counts = (both.image_grid_thw.prod(-1) // 4).tolist()
    pads = torch.nonzero(whole == IMAGE_PAD).flatten()
    second = int(pads[counts[0]])  # the second image's first token
    ids, kept = encode_image_prompt(tokenizer, messages, images, thinking=False,
                                    max_prompt_tokens=len(whole) - second + 1)  # the cut reaches into image 1's end
    assert len(kept.image_grid_thw) == 1 and kept.image_grid_thw.tolist() == both.image_grid_thw[1:].tolist()
    assert int((ids == IMAGE_PAD).sum()) == counts[1] and ids.tolist() == whole[second - 1 :].tolist()
    assert torch.equal(kept.pixel_values, both.pixel_values[int(both.image_grid_thw[0].prod()):])
    ids, kept = encode_image_prompt(tokenizer, messages, images, thinking=False, max_prompt_tokens=len(whole) - second)
    assert kept.image_grid_thw.tolist() == both.image_grid_thw[1:].tolist() and ids.tolist() == whole[second:].tolist()
    ids, kept = encode_image_prompt(tokenizer, messages, images, thinking=False,
                                    max_prompt_tokens=len(whole) - second - 1)  # through image 2: both left out
    assert kept is None and int((ids == IMAGE_PAD).sum()) == 0 and len(ids) < len(whole) - second - 1
    assert "2 of its 2 images left out whole" in caplog.text  # never a silent loss


def test_regenerate_answers_image_prompts_with_their_images_and_keeps_them(tmp_path, vl_target):
    """The local backend of an image-text target answers each user turn seeing its images (as HF's greedy `generate`
    of the prompt with them); the written rows keep their image parts, which the data reader reads back."""
    import json

    from dflash_trainer import cli
    from dflash_trainer.data.config import DataConfig
    from dflash_trainer.data.sources import load_conversations
    from dflash_trainer.target.stop_tokens import stop_token_ids
    from tests.test_vlm_target import image_row, write_rows

    (tmp_path / "data" / "img").mkdir(parents=True)  # relative image paths start at the data file's folder
    png(tmp_path / "data" / "img" / "a.png", 40, 70, 0)
    png(tmp_path / "data" / "img" / "b.png", 64, 48, 1)
    inline = data_url(50, 40, 2)
    two_turns = image_row(["img/b.png"], question="What is this?")
    two_turns["messages"] += [{"role": "user", "content": "And its colours?"}]
    rows = [image_row(["img/a.png"]), image_row([inline, "img/b.png"], question="Compare them."), two_turns,
            {"messages": [{"role": "user", "content": "No picture here."}]}]
    source = write_rows(tmp_path / "data" / "rows.jsonl", rows)
    out = tmp_path / "regen"
    tiny = ["target.random_init=tiny-qwen3-vl", "target.tokenizer=tiny:qwen3-vl", "target.dtype=float32",
            "run.device=cpu", "regenerate.max_new_tokens=12", "logging.progress=false"]
    assert cli.main(["regenerate", "--out", str(out), f"data.path={source}", *tiny]) == 0

    written = [json.loads(line) for f in sorted(out.glob("shard_*.jsonl")) for line in f.read_text().splitlines()]
    assert len(written) == 4
    read = load_conversations(DataConfig(path=str(out)), seed=0, images=True)
    assert read.report.dropped == {} and len(read.conversations) == 4
    by_question = {c.messages[0].content: c for c in read.conversations}
    a_png, b_png = str(tmp_path / "data" / "img" / "a.png"), str(tmp_path / "data" / "img" / "b.png")
    assert [i.url for i in by_question["What is in this picture?"].messages[0].images] == [a_png]
    assert [i.url for i in by_question["Compare them."].messages[0].images] == [inline, b_png]
    assert [i.url for i in by_question["What is this?"].messages[0].images] == [b_png]

    tokenizer = build_tiny_tokenizer("qwen3-vl")
    images = build_tiny_image_tokens("qwen3-vl")
    stops = stop_token_ids(tokenizer, vl_target)
    replies = 0
    for conversation in read.conversations:
        messages = conversation.messages
        for k, message in enumerate(messages):
            if message.role != "assistant":
                continue
            ids, prompt_images = encode_image_prompt(tokenizer, messages[:k], images, thinking=False,
                                                     max_prompt_tokens=4096)
            kwargs = {} if prompt_images is None else {
                "pixel_values": prompt_images.pixel_values, "image_grid_thw": prompt_images.image_grid_thw,
                "mm_token_type_ids": (ids[None] == IMAGE_PAD).int()}
            vl_target.model.rope_deltas = None
            tokens = vl_target.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]),
                                        do_sample=False, max_new_tokens=12, eos_token_id=list(stops), pad_token_id=0,
                                        **kwargs)[0, len(ids):].tolist()
            vl_target.model.rope_deltas = None
            end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
            assert message.content == tokenizer.decode(tokens[:end], skip_special_tokens=False)
            replies += 1
    assert replies == 5


def test_eval_prompts_keep_their_image_parts_and_a_text_target_refuses_them(tmp_path):
    import json

    from dflash_trainer.errors import DataError
    from dflash_trainer.eval.evaluate import encode_prompts, load_prompt_messages
    from tests.test_vlm_target import image_row

    (tmp_path / "img").mkdir()
    png(tmp_path / "img" / "a.png", 40, 40, 0)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(image_row(["img/a.png"])) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "text"}]}) + "\n")
    image_prompt, text_prompt = load_prompt_messages(path, 8)
    assert image_prompt == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(tmp_path / "img" / "a.png")}},
        {"type": "text", "text": "What is in this picture?"}]}]
    assert text_prompt == [{"role": "user", "content": "text"}]
    tokenizer = build_tiny_tokenizer("qwen3-vl")
    with pytest.raises(DataError, match="eval prompt 1 has images and the target has no image processor"):
        encode_prompts(tokenizer, [image_prompt, text_prompt], thinking=False, max_prompt_tokens=512)
    images = build_tiny_image_tokens("qwen3-vl")
    (ids, text_ids), (first, none) = encode_prompts(tokenizer, [image_prompt, text_prompt], thinking=False,
                                                    max_prompt_tokens=512, images=images)
    assert none is None and first.image_grid_thw.tolist() == [[1, 2, 2]]  # 40 x 40 pixels: a 2 x 2 patch grid
    assert int((ids == IMAGE_PAD).sum()) == 1 and not (text_ids == IMAGE_PAD).any()
    (tmp_path / "img" / "a.png").unlink()  # a prompt whose image is gone is named, with its line
    with pytest.raises(DataError, match=r"prompts\.jsonl:1: .*unreadable_image"):
        load_prompt_messages(path, 8)
