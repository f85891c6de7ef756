"""`dflash-train synthesize --out DIR`: the target writes its own prompts (Magpie-style) and answers them.

Train on the result with `data.path=DIR` (or mix it with other data through `data.sources`); with
`synthesize.answer=false`, answer it first with `dflash-train regenerate data.path=DIR --out ANSWERS`. Rerun the
same command to resume after a crash or Ctrl-C, or with a larger `synthesize.num_prompts` to add to it. The
command fails (exit 2) when it kept no conversation, or when failed requests stopped it short of
`num_prompts` (the conversations written are kept; the message names the failures per kind and how to finish).
"""

from __future__ import annotations

import argparse
import logging

from dflash_trainer.commands.out_dir import checked_out_dir
from dflash_trainer.commands.regenerate import build_backend
from dflash_trainer.config import Config
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.regen.failures import what_to_do
from dflash_trainer.synth.runner import SynthSummary, synthesize
from dflash_trainer.synth.store import synth_seed, synth_settings
from dflash_trainer.synth.template import UserTurns, find_user_turns
from dflash_trainer.synth.writers import LocalWriter, OpenAIWriter, Sampling, Writer

log = logging.getLogger(__name__)


def build_writer(config: Config, turns: UserTurns) -> Writer:
    """The writer over `regenerate.backend`: the target loaded here, or the server checked."""
    syn, regen = config.synthesize, config.regenerate
    answers = build_backend(config)
    if regen.backend == "openai":
        sampling = Sampling(temperature=syn.temperature, top_p=syn.top_p, max_new_tokens=syn.max_new_tokens,
                            seed=synth_seed(config))
        return OpenAIWriter(backend=answers, tokenizer=turns.tokenizer, turns=turns, sampling=sampling)
    from dflash_trainer.regen.local import LocalBackend

    prompts = LocalBackend(model=answers.model, tokenizer=turns.tokenizer, max_new_tokens=syn.max_new_tokens,
                           temperature=syn.temperature, top_p=syn.top_p, thinking=regen.thinking,
                           batch_size=syn.batch_size, max_prompt_tokens=regen.max_prompt_tokens,
                           extra_stop_ids=turns.end_token_ids)
    return LocalWriter(prompts=prompts, answers=answers, turns=turns, seed=synth_seed(config),
                       answer_seed=answers.seed)


def template_name(config: Config) -> str:
    if config.data.chat_template is not None:
        return f"data.chat_template={config.data.chat_template}"
    return f"the tokenizer's, {config.target.tokenizer or config.target.path}"


def run(config: Config, args: argparse.Namespace) -> int:
    out = getattr(args, "out", None)
    if not out:
        raise ConfigError("dflash-train synthesize needs --out DIR (the new dataset; train on it with data.path=DIR)")
    checked_out_dir(out)
    syn = config.synthesize
    settings = synth_settings(config)  # fails early on a missing model name
    from dflash_trainer.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    turns = find_user_turns(tokenizer, template=template_name(config), thinking=config.regenerate.thinking,
                            system_prompt=syn.system_prompt)
    prefix = turns.prefix(turns.system)
    log.info("the user-turn prefix (template: %s) ends %r; a user turn ends at %r", turns.template, prefix[-120:],
             turns.end_of_turn)
    if config.regenerate.thinking != config.data.thinking:
        log.warning("regenerate.thinking=%s but data.thinking=%s: training renders the answers with data.thinking; "
                    "set both to how the target will be served", config.regenerate.thinking, config.data.thinking)
    writer = build_writer(config, turns)
    count = None
    if syn.min_tokens is not None or syn.max_tokens is not None:
        def count(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    source = {"synthesize": {"template": turns.template, "user_turn_prefix": prefix,
                             "end_of_turn": turns.end_of_turn}}
    try:
        summary = synthesize(writer=writer, turns=turns, config=syn, settings=settings, out_dir=out, source=source,
                             count_tokens=count, progress=config.logging.progress)
    except KeyboardInterrupt:
        print(f"synthesize: interrupted; the rows written are kept in {out}. Rerun the same command to resume.")
        return 130
    print(_report(summary, answered=syn.answer))
    return 0


LOOSEN = "loosen the filters (synthesize.min_chars, max_new_tokens, keep_truncated) or check the target"


def _report(s: SynthSummary, *, answered: bool) -> str:
    """What was written; a DataError when nothing was, or when failed requests stopped the run short."""
    dropped = ", ".join(f"{reason} {n}" for reason, n in sorted(s.dropped.items(), key=lambda kv: -kv[1]))
    cut = ", ".join(f"{reason} {n}" for reason, n in s.cut.items())
    failed = s.failed_requests()
    failures = f"; {failed.line()}" if failed.total else ""
    if s.kept == 0:
        fix = what_to_do(failed, limit_fix=LOOSEN if s.dropped or not failed.total else "")
        raise DataError(f"synthesize wrote no conversation to {s.out_dir}: of {s.attempts} openings sampled, dropped "
                        f"{dropped or 'none'}{failures}; nothing to train on. {fix}, then rerun the same command")
    done = (f"synthesize: {s.kept} conversations kept ({s.new} new) of {s.wanted} wanted, from {s.attempts} openings "
            f"sampled; dropped: {dropped or 'none'}{failures}" + (f"; cut short: {cut}" if cut else "")
            + f". Output in {s.out_dir}")
    if not s.complete:
        print(done)
        raise DataError(f"{s.out_dir} is partial: {s.wanted - s.kept} of {s.wanted} conversations missing, "
                        f"{failed.line()}. {what_to_do(failed)}, then rerun the same command to finish: the {s.kept} "
                        "conversations written are kept")
    lines = [done,
             f"synthesize: {s.new} new in {s.seconds:.1f} s ({s.new / max(s.seconds, 1e-9):.1f} conversations/s)"]
    if s.kept < s.wanted:
        lines.append(f"synthesize: stopped at synthesize.max_attempts={s.max_attempts}; raise it, or loosen the "
                     "filters, and rerun to add more")
    if answered:
        lines.append(f"Train on it with data.path={s.out_dir}")
    else:
        lines.append(f"Answer it with: dflash-train regenerate data.path={s.out_dir} --out ANSWERS_DIR")
    return "\n".join(lines)
