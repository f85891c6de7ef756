"""`regenerate` with the openai backend on rows with image parts: the images reach the server intact, the rows are
written back with them (as the local backend writes them), and a server that takes no images stops the run with
one message that names it and the fix."""

from __future__ import annotations

import argparse
import base64
import io
import json

import numpy as np
import pytest
from fake_openai_server import Behaviour, FakeServer
from PIL import Image

from dflash_trainer.config import load_config
from dflash_trainer.data.config import DataConfig
from dflash_trainer.data.sources import load_conversations
from dflash_trainer.regen import read_manifest, read_rows
from dflash_trainer.regen.openai import ImagesRefused, images_refused
from dflash_trainer.regen.turns import as_dicts
from tests.test_vlm_target import data_url, image_row, png, write_rows


def image_data(folder):
    """Rows with a PNG file, a JPEG file named .png, a data URL, a second (text) user turn, and a text row."""
    (folder / "img").mkdir(parents=True)
    png(folder / "img" / "a.png", 40, 70, 0)
    pixels = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / "img" / "really_a_jpeg.png", format="JPEG")
    inline = data_url(30, 20, 2)
    two_turns = image_row(["img/really_a_jpeg.png"], question="What is this?")
    two_turns["messages"] += [{"role": "user", "content": "And its colours?"}]
    rows = [image_row(["img/a.png"]), image_row([inline, "img/a.png"], question="Compare them."), two_turns,
            {"messages": [{"role": "user", "content": "No picture here."}]}]
    return write_rows(folder / "rows.jsonl", rows), inline


def command_config(source, server, *extra):
    return load_config(None, [f"data.path={source}", "target.random_init=tiny", "regenerate.backend=openai",
                              f"regenerate.url={server.url}",
                              "regenerate.model=tiny-model", "regenerate.retry_backoff_s=0.01",
                              "logging.progress=false", *extra])


def test_the_openai_backend_sends_each_image_intact_and_writes_the_rows_back_with_them(tmp_path, capsys):
    from dflash_trainer.commands import regenerate as command

    source, inline = image_data(tmp_path / "data")
    a_png, jpeg = tmp_path / "data" / "img" / "a.png", tmp_path / "data" / "img" / "really_a_jpeg.png"
    with FakeServer() as server:
        assert command.run(command_config(source, server), argparse.Namespace(out=str(tmp_path / "out"))) == 0
        requests = list(server.behaviour.requests)
    assert "4 rows done (4 new) of 4 conversations" in capsys.readouterr().out

    # each request's image parts: a file as a data URL of its bytes, typed by what the bytes are; a data URL as given
    sent: dict[str, list[str]] = {}
    for request in requests:
        for message in request["messages"]:
            if isinstance(message["content"], list):
                text = "".join(p["text"] for p in message["content"] if p["type"] == "text")
                sent.setdefault(text, []).extend(p["image_url"]["url"] for p in message["content"]
                                                 if p["type"] == "image_url")
    file_url = lambda path, mime: f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()  # noqa: E731
    assert sent["What is in this picture?"] == [file_url(a_png, "image/png")]
    assert sent["Compare them."] == [inline, file_url(a_png, "image/png")]
    # the second turn's request carries the first turn (its image included) again
    assert sent["What is this?"] == [file_url(jpeg, "image/jpeg")] * 2
    decoded = base64.b64decode(sent["What is this?"][0].split(",", 1)[1])
    assert decoded == jpeg.read_bytes() and Image.open(io.BytesIO(decoded)).format == "JPEG"
    assert len(requests) == 5  # one per user turn

    # the rows are written as the local backend writes them (image parts by absolute path, a data URL as it was),
    # with the server's replies, and read back with their images, ready to train on
    read = load_conversations(DataConfig(path=str(tmp_path / "out")), seed=0, images=True)
    assert read.report.dropped == {} and len(read.conversations) == 4
    written = {row["messages"][0]["content"] if isinstance(row["messages"][0]["content"], str)
               else row["messages"][0]["content"][-1]["text"]: row for row in read_rows(tmp_path / "out")}
    by_question = {c.messages[0].content: c for c in read.conversations}
    for question, conversation in by_question.items():
        assert written[question]["messages"] == as_dicts(conversation.messages)
    assert written["Compare them."]["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": inline}}, {"type": "image_url", "image_url": {"url": str(a_png)}},
        {"type": "text", "text": "Compare them."}]
    assert [m.content for m in by_question["What is this?"].messages] == [
        "What is this?", "re:What is this?", "And its colours?", "re:And its colours?"]
    assert [i.url for i in by_question["What is this?"].messages[0].images] == [str(jpeg)]


def test_a_server_that_takes_no_images_stops_the_run_with_the_fix_and_drop_images_leaves_them_out(tmp_path, capsys):
    from dflash_trainer.commands import regenerate as command

    source, _ = image_data(tmp_path / "data")
    behaviour = Behaviour(refuse_images="tiny-model is not a multimodal model")  # vLLM's words
    with FakeServer(behaviour) as server:
        config = command_config(source, server, "regenerate.concurrency=1")
        with pytest.raises(ImagesRefused, match=rf"the server at {server.url} \(model 'tiny-model'\) refused a "
                                                r"prompt's images \(HTTP 400: .*is not a multimodal model.*Serve an "
                                                r"image-text model.*regenerate.drop_images=true"):
            command.run(config, argparse.Namespace(out=str(tmp_path / "out")))
        refused = [r for r in behaviour.requests if isinstance(r["messages"][0]["content"], list)]
        assert len(refused) == 1  # the first image prompt stops it: no image row is failed one by one

        dropped = command_config(source, server, "regenerate.drop_images=true")
        assert command.run(dropped, argparse.Namespace(out=str(tmp_path / "text"))) == 0
    assert "1 rows done (1 new) of 1 conversations" in capsys.readouterr().out
    assert [r["messages"][0]["content"] for r in read_rows(tmp_path / "text")] == ["No picture here."]
    assert read_manifest(tmp_path / "text")["source"]["report"]["dropped"] == {"images_not_read": 3}


@pytest.mark.parametrize("detail, refused", [
    ('{"error": {"message": "Qwen/Qwen3-8B is not a multimodal model", "type": "BadRequestError"}}', True),  # vLLM
    ("At most 0 image(s) may be provided in one prompt.", True),  # vLLM, images turned off
    ("At most 1 image(s) may be provided in one prompt. Set `--limit-mm-per-prompt` to increase this limit.", True),
    ("image input is not supported for this model", True),  # SGLang
    ("Invalid content type. image_url is only supported by certain models.", True),  # OpenAI
    ("This model does not support image inputs", True),
    ("Multimodal input is not supported by this server", True),
    # vLLM's length refusal on an image-text model names image tokens: a row's limit, not the server's
    ("The decoder prompt (length 40000) is longer than the maximum model length of 32768. Make sure that "
     "`max_model_len` is no smaller than the number of text tokens plus multimodal tokens. For image inputs, the "
     "number of image tokens depends on the number of images, and possibly their aspect ratios as well.", False),
    ("This model's maximum context length is 4096 tokens", False),
    ("prompt too long", False),
])
def test_refusals_that_name_the_images_are_told_from_length_refusals(detail, refused):
    assert images_refused(f"HTTP 400: {detail}") is refused
