"""Real tau during a split run: the first target rank evaluates the drafter the leader drafter sends it.

The leader exports the drafter (`RUN_DIR/.eval/step_N/`, on the run dir that every rank shares) and posts
a request in the store; the first target rank serves requests between jobs: its job pulling pauses while it
runs speculative decoding with its own target, then it posts the result and keeps the best drafter by tau
in `RUN_DIR/best/`. The leader logs results as they arrive and waits only for the final one. An explicit
end request tells the server that no more will come.

Store values: `eval_request/K` = an `EvalRequest`, `eval_result/K` = a `TauSummary`, both as JSON.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from dflash_trainer.config import Config
from dflash_trainer.rundir import RunDir
from dflash_trainer.runtime.control import ControlPlane
from dflash_trainer.target.head import TargetHead
from dflash_trainer.train.micro_step import compile_forward_train, plan_step_chunks
from dflash_trainer.train.tau_eval import TauSummary, summary_values

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalRequest:
    """From the leader drafter to the first target rank: evaluate the export at `path`, or stop serving."""

    step: int = -1
    """Optimizer step the drafter was exported at."""
    path: str = ""
    """Export directory on the run dir that every rank shares."""
    end: bool = False
    """No more requests will come."""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def decode(raw: str) -> "EvalRequest":
        return EvalRequest(**json.loads(raw))


def eval_enabled(config: Config) -> bool:
    """Identical on every rank: tau is measured periodically or at the end, and prompts are configured or
    held out (the held-out file itself is written by rank 0 before any role starts)."""
    if config.eval.interval == 0 and not config.eval.at_end:
        return False
    return bool(config.eval.prompts) or config.data.num_eval_conversations > 0


def make_tau_tracker(config: Config, *, target, capture, head: TargetHead, run_dir: Path, device: torch.device):
    """A TauTracker over the run's held-out prompts (validated on their replies too, where they have some), or
    None (with a warning) when there are none."""
    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.eval.drafter_eval import eval_prompts_path
    from dflash_trainer.eval.validation import build_validator
    from dflash_trainer.train.tau_eval import TauTracker

    path = eval_prompts_path(config)
    if not path.is_file() or path.stat().st_size == 0:
        log.warning("no held-out prompts at %s: real tau is not measured (set data.num_eval_conversations > 0)", path)
        return None
    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    validator = build_validator(config, capture=capture, head=head, tokenizer=tokenizer, conversations_path=path,
                                device=device)
    if validator is None:
        log.warning("the held-out conversations in %s have no replies: no held-out validation (walk tau)", path)
    return TauTracker(config, target=target, tokenizer=tokenizer, head=head, prompts_path=path, run_dir=run_dir,
                      validator=validator)


class SplitEvalClient:
    """On the leader drafter: sends drafters to evaluate and collects the results."""

    def __init__(self, control: ControlPlane, run_dir: Path) -> None:
        self.control = control
        self.run_dir = Path(run_dir)
        self.posted = 0
        self.collected = 0
        self.steps: dict[int, int] = {}
        self.last: Optional[TauSummary] = None

    def request(self, trainer, step: int, model) -> None:
        path = RunDir(self.run_dir).eval_exports / f"step_{step}"
        trainer.export(path, model)
        self.posted += 1
        self.steps[self.posted] = step
        self.control.set_value(f"eval_request/{self.posted}", EvalRequest(step=step, path=str(path)).encode())

    def poll(self, sink) -> None:
        """Log the results that have arrived (no waiting)."""
        while self.collected < self.posted and self.control.has_value(f"eval_result/{self.collected + 1}"):
            self._collect(sink)

    def _collect(self, sink) -> None:
        self.collected += 1
        self.last = TauSummary(**json.loads(self.control.wait_value(f"eval_result/{self.collected}")))
        sink.log(self.last.step, summary_values(self.last))

    def finish(self, trainer, step: int, model, *, at_end: bool, sink) -> Optional[TauSummary]:
        """Evaluate the final drafter (when asked and not just done), wait for every result, end the server."""
        if at_end and step > 0 and (not self.steps or self.steps[self.posted] != step):
            self.request(trainer, step, model)
        while self.collected < self.posted:
            self._collect(sink)  # waits (bounded by pipeline.timeout_s) for the server
        self.control.set_value(f"eval_request/{self.posted + 1}", EvalRequest(end=True).encode())
        shutil.rmtree(RunDir(self.run_dir).eval_exports, ignore_errors=True)
        return self.last


class SplitEvalServer:
    """On the first target rank: evaluates requested drafters with its target, between jobs."""

    def __init__(self, control: ControlPlane, tracker, *, device: torch.device) -> None:
        self.control = control
        self.tracker = tracker
        self.device = device
        self.next = 1
        self.ended = False
        self.blocks_per_chunk: Optional[int] = None
        """Validation's chunk of blocks on this rank, planned from its free memory at the first request."""

    def pausing(self, source):
        """`source` whose `next_job` first serves the evaluation requests that are waiting."""
        server = self

        class _Pausing:
            def next_job(self):
                server.serve_pending()
                return source.next_job()

        return _Pausing()

    def serve_pending(self) -> None:
        while not self.ended and self.control.has_value(f"eval_request/{self.next}"):
            self._serve(EvalRequest.decode(self.control.wait_value(f"eval_request/{self.next}")))

    def serve_until_end(self) -> None:
        """After the last job: serve until the leader's end request (each wait bounded by pipeline.timeout_s)."""
        while not self.ended:
            self._serve(EvalRequest.decode(self.control.wait_value(f"eval_request/{self.next}")))

    def _serve(self, request: EvalRequest) -> None:
        from dflash_trainer.drafter.export import load_drafter

        index = self.next
        self.next += 1
        if request.end:
            self.ended = True
            return
        path = Path(request.path)
        drafter = load_drafter(path).to(self.device)
        if self.device.type == "cuda":  # validation runs the training forward (flex attention: compiled)
            compile_forward_train(drafter)
        if self.blocks_per_chunk is None:
            self.blocks_per_chunk = plan_step_chunks(self.tracker.config, drafter, self.device).blocks_per_chunk
        summary = self.tracker.evaluate(drafter, request.step, export=lambda out: shutil.copytree(path, out),
                                        blocks_per_chunk=self.blocks_per_chunk)
        self.control.set_value(f"eval_result/{index}", json.dumps(asdict(summary)))
