"""Image-text families trained and evaluated with their images (issue 63), each from a tiny random config of its own
config class and a tiny processor of its own kind: the image tokens are what the family's HF processor makes, the taps
at every position are what HF's forward of the conversation with its images gives (Gemma's bidirectional attention
over an image's tokens included), a training run forwards the images, and decoding image prompts is lossless against
HF's own `generate` with the images. Qwen3-VL (deepstack taps) has its own tests: test_vlm_target.py, test_vlm_decode.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from dflash_trainer.data.config import DataSourceConfig
from dflash_trainer.data.images import decode_image
from dflash_trainer.data.sources import load_source
from dflash_trainer.data.tiny_tokenizer import build_tiny_image_tokens, build_tiny_tokenizer
from dflash_trainer.data.tokenized import TokenizedDataset
from dflash_trainer.eval.image_prompts import encode_image_prompt, message_rows
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import find_decoder, image_text_model, load_target
from tests.drafter_helpers import single_thread  # noqa: F401 (autouse fixture)
from tests.test_target_capture import capture
from tests.test_vlm_decode import NEW, assert_decodes_as_alone
from tests.test_vlm_target import REPLY, data_url, image_conversations, image_row, png, tokenize, write_rows

FAMILIES = {  # preset: its tiny tokenizer and processor (`tiny:<family>`)
    "tiny-gemma3-vl": "gemma3",
    "tiny-qwen3.5-vl": "qwen3.5",
    "tiny-gemma4-vl": "gemma4",
    "tiny-llama4-vl": "llama4",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(preset, tokenizer family, its image tokens, the target)."""
    preset, kind = request.param, FAMILIES[request.param]
    target = load_target(TargetConfig(random_init=preset, dtype="float32", compile=False, attn_implementation="eager"),
                         "cpu", seed=0)
    return SimpleNamespace(preset=preset, kind=kind, images=build_tiny_image_tokens(kind), target=target,
                           tokenizer=build_tiny_tokenizer(kind))


def hf_image_inputs(family, ids: torch.Tensor, pil_images) -> dict:
    """The image keywords HF's forward / `generate` takes for `ids` (1, S), from the family's own image processor run
    on the images now (not our stored rows)."""
    if not pil_images:
        return {}
    out = family.images.image_processor(images=pil_images, return_tensors="pt")
    image = (ids == family.images.image_token_id).long()  # (1, S)
    if family.kind == "gemma3":
        return {"pixel_values": out["pixel_values"], "token_type_ids": image}
    if family.kind == "gemma4":
        return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"],
                "mm_token_type_ids": image}
    if family.kind == "llama4":
        return {"pixel_values": out["pixel_values"]}
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"], "mm_token_type_ids": image}


def hf_processor_ids(family, text: str, pil_images) -> list[int]:
    """What the family's HF processor class makes of the rendered `text` (the template's placeholders) and images."""
    if family.kind == "gemma3":
        from transformers import Gemma3Processor

        processor = Gemma3Processor(image_processor=family.images.image_processor, tokenizer=family.tokenizer,
                                    image_seq_length=family.images.tokens_per_image)
        return processor(text=text, images=pil_images, return_tensors="pt")["input_ids"][0].tolist()
    if family.kind == "gemma4":  # its processor class needs an audio feature extractor and a video processor (torchvision):
        from transformers import Gemma4Processor  # its own replacement text of each image, by hand

        out = family.images.image_processor(images=pil_images, return_tensors="pt")
        tokenizer = family.tokenizer
        names = SimpleNamespace(boi_token=tokenizer.boi_token, image_token=tokenizer.image_token,
                                eoi_token=tokenizer.eoi_token)
        pieces = text.split(tokenizer.image_token)
        text = pieces[0] + "".join(Gemma4Processor.replace_image_token(names, out, i) + piece
                                   for i, piece in enumerate(pieces[1:]))
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if family.kind == "llama4":  # its processor class's own text of each image (the class needs no torchvision)
        from transformers import Llama4Processor

        out = family.images.image_processor(images=pil_images, return_tensors="pt")
        names = SimpleNamespace(patch_size=family.images.patch_size, downsample_ratio=family.images.downsample,
                                _prompt_split_image=lambda *a: Llama4Processor._prompt_split_image(None, *a))
        pieces = text.split("<|image|>")
        text = pieces[0] + "".join(Llama4Processor.replace_image_token(names, out, i) + piece
                                   for i, piece in enumerate(pieces[1:]))
        return family.tokenizer(text, add_special_tokens=False)["input_ids"]
    merge = family.images.image_processor.merge_size ** 2  # Qwen-VL: one pad per merged patch
    grids = family.images.image_processor(images=pil_images, return_tensors="pt")["image_grid_thw"]
    for grid in grids:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * int(grid.prod() // merge), 1)
    return family.tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"), add_special_tokens=False)["input_ids"]


def read(tmp_path, rows):
    return load_source(DataSourceConfig(path=str(write_rows(tmp_path / "d.jsonl", rows))), images=True).conversations


def test_image_tokens_are_the_family_processors(family, tmp_path):
    rows = [image_row([str(png(tmp_path / "a.png", 40, 70, 0)), str(png(tmp_path / "b.png", 64, 64, 1))])]
    (conversation,) = read(tmp_path, rows)
    (seq,) = tokenize([conversation], family.tokenizer, family.images)
    pil = [Image.open(tmp_path / n).convert("RGB") for n in ("a.png", "b.png")]
    text = family.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
         {"role": "assistant", "content": REPLY}], tokenize=False, enable_thinking=False)
    assert seq.input_ids.tolist() == hf_processor_ids(family, text, pil)
    image = seq.input_ids == family.images.image_token_id
    assert int(image.sum()) == int(family.images.process(conversation.messages[0].images).token_counts.sum()) > 2
    assert not (seq.loss_mask & image).any() and int(seq.loss_mask.sum()) > 20
    read_back = TokenizedDataset.from_sequences([(conversation, seq)], family.images)[0]  # pixels made on read
    assert seq.image_grid_thw.prod(-1).sum() == len(read_back.pixel_values)  # rows as stored: the grid counts them


def test_taps_of_image_conversations_equal_hf_forward_with_their_images(family, tmp_path):
    """Packed as rows of one right-padded batch (two image conversations, a text one between), each conversation's
    taps equal HF's `output_hidden_states` of the image-text model run on it alone with its images as the family's
    processor makes them; and the images change the taps."""
    rows = [image_row([str(png(tmp_path / "a.png", 40, 70, 0))]),
            {"messages": [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": REPLY}]},
            image_row([str(png(tmp_path / "b.png", 64, 96, 1)), str(png(tmp_path / "c.png", 50, 40, 2))],
                      question="Compare them.")]
    conversations = read(tmp_path, rows)
    sequences = tokenize(conversations, family.tokenizer, family.images)
    dataset = TokenizedDataset.from_sequences(zip(conversations, sequences), family.images)
    sequences = [dataset[i] for i in range(3)]  # through the dataset's flat image storage
    assert [s.image_grid_thw is None for s in sequences] == [False, True, False] and len(sequences[2].image_grid_thw) == 2
    taps, target = [0, 2, 4], family.target
    hidden = target.config.get_text_config().hidden_size
    _, out = capture(target, sequences, taps, token_budget=sum(s.num_tokens for s in sequences))
    pictures = [["a.png"], [], ["b.png", "c.png"]]
    start = 0
    for seq, names in zip(sequences, pictures):
        ids = seq.input_ids[None]
        kwargs = hf_image_inputs(family, ids, [Image.open(tmp_path / n).convert("RGB") for n in names])
        with torch.no_grad():
            states = target(input_ids=ids, output_hidden_states=True, **kwargs).hidden_states
        for k, layer in enumerate(taps):
            got = out.taps[start : start + seq.num_tokens, k * hidden : (k + 1) * hidden]
            # fp32 sums in another order (rows of a padded batch, not one alone) on Gemma's scaled embeddings
            torch.testing.assert_close(got, states[layer + 1][0], atol=2e-4, rtol=1e-4)
        start += seq.num_tokens
    with torch.no_grad():  # the image changes the taps (the vision tower ran): not the text-only forward of the ids
        text_only = find_decoder(target)(input_ids=sequences[0].input_ids[None], output_hidden_states=True).hidden_states
    assert not torch.allclose(out.taps[: sequences[0].num_tokens, hidden : 2 * hidden], text_only[3][0], atol=1e-3)


def hf_generate(family, ids, pil_images):
    """HF's own greedy `generate` of one prompt with its images: exactly NEW tokens (no stop)."""
    target, inner = family.target, image_text_model(family.target)
    if hasattr(inner, "rope_deltas"):  # Qwen-VL's decoding state, which a prompt alone starts without
        inner.rope_deltas = None
    out = target.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                          max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
                          **hf_image_inputs(family, ids[None], pil_images))
    if hasattr(inner, "rope_deltas"):
        inner.rope_deltas = None
    return out[0, len(ids):].tolist()


def test_image_prompts_decode_losslessly_with_their_images(family, tmp_path):
    """Left-padded rows of image prompts (one image, two images, text, an image mid-turn) decode as HF's `generate` of
    each alone with its images (`assert_decodes_as_alone`)."""
    png(tmp_path / "a.png", 40, 70, 0), png(tmp_path / "b.png", 64, 96, 1), png(tmp_path / "c.png", 64, 64, 3)

    def image(name):
        return {"type": "image_url", "image_url": {"url": name}}

    turns = [[image("a.png"), {"type": "text", "text": "What is in this picture?"}],
             [image("b.png"), image(data_url(50, 40, 2)), {"type": "text", "text": "Compare the two."}],
             "Say something about noise.",
             [{"type": "text", "text": "Look:"}, image("c.png"), {"type": "text", "text": "and describe it."}]]
    messages = [message_rows([{"role": "user", "content": t}], tmp_path) for t in turns]
    encoded = [encode_image_prompt(family.tokenizer, m, family.images, thinking=False, max_prompt_tokens=4096)
               for m in messages]
    prompts, images = [ids for ids, _ in encoded], [i for _, i in encoded]
    assert [i is None for i in images] == [False, False, True, False]
    pil = [[decode_image(r.url) for r in m[0].images] for m in messages]
    alone = [hf_generate(family, ids, p) for ids, p in zip(prompts, pil)]
    assert hf_generate(family, prompts[0], []) != alone[0]  # the images matter

    assert_decodes_as_alone(family.target, prompts, images, alone)


@pytest.mark.parametrize("preset", [*FAMILIES, "tiny-qwen3-vl"])
def test_family_trains_and_measures_tau_on_image_conversations(preset, tmp_path, monkeypatch):
    """Training forwards each batch's images through the image-text model; the held-out split keeps image
    conversations, and training's tau, validation and `dflash-train eval` decode their prompts with the images,
    losslessly (greedy match rate 1.0 in fp32)."""
    from dflash_trainer import cli
    from dflash_trainer.eval import batched
    from dflash_trainer.target.capture import TapCapture
    from tests.pipeline_helpers import summary, train_in_process

    trained_images, decoded_images = [], []
    forward, prefill = TapCapture._forward_with_images, batched.image_prefill
    monkeypatch.setattr(TapCapture, "_forward_with_images",
                        lambda self, inputs: (trained_images.append(len(inputs.image_grid_thw)), forward(self, inputs)))
    monkeypatch.setattr(batched, "image_prefill", lambda target, ids, valid, images: (
        decoded_images.append(sum(i is not None for i in images)), prefill(target, ids, valid, images))[1])
    data = write_rows(tmp_path / "train.jsonl", image_conversations(tmp_path, 12))
    run = tmp_path / "run"
    assert train_in_process(run, f"target.random_init={preset}", f"target.tokenizer=tiny:{FAMILIES.get(preset, 'qwen3-vl')}",
                            "target.dtype=float32", f"data.path={data}", "data.num_eval_conversations=3",
                            "train.max_steps=2", "train.num_epochs=100", "eval.at_end=true", "eval.num_prompts=3",
                            "eval.max_new_tokens=12", f"data.cache_dir={tmp_path / 'cache'}") == 0
    held = [json.loads(line) for line in (run / "plan" / "eval.jsonl").read_text().splitlines()]
    assert len(held) == 3 and all(isinstance(r["messages"][0]["content"], list) for r in held)
    result = summary(run)
    assert result["status"] == "ok" and result["steps"] == 2 and sum(trained_images) >= 2
    assert result["eval"]["val"]["replies"] == 3  # validation kept the image rows
    assert decoded_images and all(n == 3 for n in decoded_images)  # training's tau decoded 3 image prompts
    decoded_images.clear()
    assert cli.main(["eval", "--config", str(run / "config.yaml"), "--drafter", str(run / "best"),
                     "run.device=cpu"]) == 0
    report = json.loads((run / "eval-best.json").read_text())
    assert report["prompts"] == 3 and report["greedy_match_rate"] == 1.0 and report["tau"] >= 1.0
    assert decoded_images == [3, 3, 3]  # the drafter's, prompt lookup's and plain decoding's passes, with the images


def test_a_family_whose_images_cannot_be_made_into_tokens_refuses_image_rows_before_the_first_step(tmp_path, monkeypatch,
                                                                                                   capsys):
    """An image-text target whose processor kind has no image tokens here: its image rows are refused in one line
    naming the processor, why and the fix, before any step (never a traceback, never trained on their text alone)."""
    from dflash_trainer.data import tokenizer as tokenizer_module
    from dflash_trainer.data.vision import UnsupportedImages, image_tokens_for
    from tests.pipeline_helpers import train_in_process

    class PixtralImageProcessor:  # a processor kind without image tokens here
        pass

    refused = image_tokens_for(PixtralImageProcessor(), build_tiny_tokenizer("qwen3-vl"), {})
    assert isinstance(refused, UnsupportedImages)
    monkeypatch.setattr(tokenizer_module, "load_image_tokens", lambda target, tokenizer: refused)
    data = write_rows(tmp_path / "train.jsonl", image_conversations(tmp_path, 6))
    run = tmp_path / "run"
    assert train_in_process(run, "target.random_init=tiny-qwen3-vl", "target.tokenizer=tiny:qwen3-vl",
                            f"data.path={data}", "train.max_steps=2", "train.num_epochs=100",
                            f"data.cache_dir={tmp_path / 'cache'}") == 2
    (line,) = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
    assert line == ("dflash-train train: error: 6 conversations have images: images of a target with a "
                    "PixtralImageProcessor are not supported yet (dflash-train knows the Qwen-VL, Gemma 3, Gemma 4 and "
                    "Llama 4 processors): remove the image parts of the data to train on its text")
    assert not list(run.glob("checkpoints/*"))


def test_gemma3_pan_and_scan_crops_are_its_processors(tmp_path):
    """With pan-and-scan on, a wide image adds its crops: the text its processor writes for them, a row each."""
    from dataclasses import replace

    from transformers import Gemma3Processor

    tokenizer = build_tiny_tokenizer("gemma3")
    images = build_tiny_image_tokens("gemma3")
    pan_and_scan = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=4,
                        pan_and_scan_min_ratio_to_activate=1.2)
    processor = type(images.image_processor)(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                             image_std=[0.5] * 3, **pan_and_scan)
    images = replace(images, image_processor=processor)
    rows = [image_row([str(png(tmp_path / "wide.png", 32, 96, 0)), str(png(tmp_path / "square.png", 40, 40, 1))])]
    (conversation,) = read(tmp_path, rows)
    (seq,) = tokenize([conversation], tokenizer, images)
    pil = [Image.open(tmp_path / n).convert("RGB") for n in ("wide.png", "square.png")]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
         {"role": "assistant", "content": REPLY}], tokenize=False, enable_thinking=False)
    out = Gemma3Processor(image_processor=processor, tokenizer=tokenizer, image_seq_length=images.tokens_per_image)(
        text=text, images=pil, return_tensors="pt", **pan_and_scan)  # its own defaults would override the settings
    assert seq.input_ids.tolist() == out["input_ids"][0].tolist()
    crops = seq.image_grid_thw[:, 0] - 1
    assert crops.tolist()[1] == 0 and crops.tolist()[0] > 0  # the wide image was cut, the square one not
    read_back = TokenizedDataset.from_sequences([(conversation, seq)], images)[0]  # pixels made on read
    torch.testing.assert_close(read_back.pixel_values, out["pixel_values"].reshape(len(out["pixel_values"]), -1))
