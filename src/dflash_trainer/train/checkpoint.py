"""Training checkpoints: written atomically, rotated, validated on resume.

Layout of `RUN_DIR/checkpoints/step_N/`: `drafter.safetensors` (fp32 weights), `optimizer.pt` (optimizer
state, loaded with weights_only=True), `rng.pt`, `state.json` (step, epoch, job ledger, scheduler, model
signature, data fingerprint) and `COMPLETE`, which records each file's size and CRC-32. A checkpoint is
written into a temporary directory and renamed into place only after `COMPLETE` is on disk, so a crash while
saving never leaves a directory that looks valid; resume and export check the sizes and checksums, so bytes
damaged later are found too, and `train.resume=latest` falls back to the newest intact checkpoint.

A damaged `COMPLETE` or `state.json` (not UTF-8, cut short, not the JSON we write) is damage like any other: the
checkpoint is skipped by `train.resume=latest` with a warning naming it (the one before it is complete in itself:
weights, optimizer, ledger and step agree, and the metrics are cut back to its step), and is a ConfigError naming
the file where it was asked for by path. Never a decoding traceback.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import resource
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.drafter.finite import check_finite
from dflash_trainer.errors import ConfigError, StorageError
from dflash_trainer.readback import damaged, decode_problem, read_json_file
from dflash_trainer.rundir import RunDir

COMPLETE = "COMPLETE"
LEGACY_MARKER = "ok\n"
"""What `COMPLETE` held before it listed each file's size and CRC-32: such a checkpoint cannot be verified."""
_CHUNK = 16 * 2**20

log = logging.getLogger(__name__)


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why the checkpoint at `path` cannot be used (a file missing, cut short or changed since it was saved, its
    `COMPLETE` or `state.json` damaged), or None when it is intact. Never raises on damage: `resolve_resume`
    skips a damaged checkpoint for the one before it."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        return f"no {COMPLETE} file (not a finished checkpoint)"
    try:
        marker = (path / COMPLETE).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        return f"its {COMPLETE} file is damaged ({decode_problem(e)})"
    if marker == LEGACY_MARKER:
        log.warning("checkpoint %s has the legacy %s marker, written before checkpoints recorded their files' "
                    "sizes and checksums: damage to its files cannot be detected; using it unchecked. Resume from "
                    "(or export) a checkpoint written since, where there is one", path, COMPLETE)
        return _state_problem(path)
    files = _listed_files(marker)
    if files is None:
        return f"its {COMPLETE} file is unreadable (cut short or damaged)"
    for name, (size, crc) in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were saved"
        if _crc32(f) != crc:
            return f"{name} does not match its checksum (its bytes changed after saving)"
    return _state_problem(path)


def _listed_files(marker: str) -> Optional[dict[str, tuple[int, str]]]:
    """The files a `COMPLETE` marker lists, name: (bytes, crc32), or None when it is not the JSON we write."""
    try:
        files = json.loads(marker)["files"]
        return {str(name): (int(want["bytes"]), str(want["crc32"])) for name, want in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _state_problem(path: Path) -> Optional[str]:
    """Why `state.json` cannot be read (checksummed with the rest, so this finds only the damage of a legacy
    checkpoint or a hand edit that rewrote `COMPLETE`), or None."""
    try:
        read_state(path)
    except ConfigError as e:
        return f"its state.json is damaged ({getattr(e, 'damage', e)})"
    return None


def state_fix(path: Path) -> str:
    """What to do about a damaged checkpoint: use the one before it (what `train.resume=latest` does by itself)."""
    return (f"delete {Path(path)} and resume from the checkpoint before it (train.resume=latest skips a damaged "
            "checkpoint by itself)")


def read_state(path: Path) -> dict[str, Any]:
    """The checkpoint's `state.json`; damaged (not UTF-8, cut short, not the object we write, a key missing) is a
    ConfigError naming it, with `state_fix`."""
    file = Path(path) / "state.json"
    fix = state_fix(path)
    state = read_json_file(file, what="checkpoint state", fix=fix, error=ConfigError)
    missing = [k for k in ("step", "epoch", "ledger", "model_signature", "data_fingerprint") if k not in state]
    if missing or not isinstance(state["ledger"], dict) or not isinstance(state["model_signature"], dict):
        problem = f"no {', '.join(missing)}" if missing else "ledger or model_signature is not an object"
        raise damaged(file, what="checkpoint state", problem=problem, fix=fix, error=ConfigError)
    return state


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointState:
    step: int
    """Optimizer steps completed."""
    epoch: int
    """Epoch in progress."""
    ledger: dict[int, list[int]]
    """Committed job ids per epoch."""
    model_signature: dict[str, Any]
    """Shapes that must match on resume (hidden size, layers, taps, block size, vocab)."""
    data_fingerprint: str
    """Hash of the tokenized data and plan settings; resume refuses other data."""
    scheduler: dict[str, Any]
    extra: dict[str, Any]
    """Metrics counters and the like."""


def checkpoints_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path,
    state: CheckpointState,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    *,
    keep_last: int,
) -> Path:
    """Write the checkpoint of `state.step` and rotate the old ones. A disk that cannot take it (full, or a file-size
    limit) is a StorageError naming the disk and the space needed; the temporary is removed and the checkpoints
    already there are kept, so the run resumes from the last of them."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step}"
    tmp = root / f".tmp-step_{state.step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_files(tmp, state, weights, optimizer_state)
    except (OSError, RuntimeError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, RuntimeError) and "inline_container" not in str(error):
            raise  # torch's writer reports a failed write so (full disk, file-size limit); anything else is a bug
        raise StorageError(_storage_problem(run_dir, final, error, _nbytes(weights) + _nbytes(optimizer_state))) from error
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _rotate(root, keep_last)
    return final


def _write_files(tmp: Path, state: CheckpointState, weights: dict[str, torch.Tensor],
                 optimizer_state: dict[str, Any]) -> None:
    save_file({k: v.detach().float().contiguous().cpu() for k, v in weights.items()}, str(tmp / "drafter.safetensors"))
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(
        {"torch": torch.get_rng_state(), "cuda": _cuda_rng()},
        tmp / "rng.pt",
    )
    payload = {
        "step": state.step,
        "epoch": state.epoch,
        "ledger": {str(e): sorted(ids) for e, ids in state.ledger.items()},
        "model_signature": state.model_signature,
        "data_fingerprint": state.data_fingerprint,
        "scheduler": state.scheduler,
        "extra": state.extra,
        "python_random": list(random.getstate()[1]),
    }
    (tmp / "state.json").write_text(json.dumps(payload))
    files = {}
    for f in sorted(tmp.iterdir()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        files[f.name] = {"bytes": f.stat().st_size, "crc32": _crc32(f)}
    (tmp / COMPLETE).write_text(json.dumps({"files": files}, indent=1) + "\n")


def _nbytes(tree: Any) -> int:
    """Bytes of the tensors in a nested dict/list (weights count in fp32, as they are saved)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * max(4, tree.element_size()) if tree.is_floating_point() else tree.nbytes
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return 0


def _storage_problem(run_dir: Path, final: Path, error: BaseException, needed: int) -> str:
    root = checkpoints_dir(run_dir)
    mount = root.resolve()
    while not os.path.ismount(mount):
        mount = mount.parent
    free = shutil.disk_usage(root).free
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limit_note = f"; files are limited to {limit / 2**30:.2f} GiB (ulimit -f)" if limit != resource.RLIM_INFINITY else ""
    done = list_checkpoints(run_dir)
    resume = (f"then --resume continues from the last complete checkpoint, {done[-1].name}" if done else
              "no checkpoint was written before this one: the run starts again")
    cause = getattr(error, "strerror", None) or str(error).splitlines()[0]
    return (f"cannot write checkpoint {final.name} to {root} ({cause}): it needs about {needed / 2**30:.2f} GiB "
            f"and the disk mounted at {mount} has {free / 2**30:.2f} GiB free{limit_note}. Free space there (fewer "
            f"checkpoints are kept with a lower train.keep_last) or move the run dir to a larger disk; {resume}")


def _cuda_rng() -> Optional[list[torch.Tensor]]:
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def _rotate(root: Path, keep_last: int) -> None:
    done = list_checkpoints(root.parent)
    best = (root / "best").resolve() if (root / "best").exists() else None
    for path in done[:-keep_last]:
        if best is None or path.resolve() != best:
            shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (other entries under `checkpoints/` are not ours and left alone)."""
    return [path for _, path in RunDir(run_dir).checkpoint_dirs() if (path / COMPLETE).is_file()]


def resolve_resume(run_dir: Path, resume: str) -> Path:
    """The checkpoint to resume from: `latest` is the newest intact one of the run (a damaged newer one is
    named in a warning and skipped), a path must be intact itself."""
    if resume == "latest":
        found = list_checkpoints(run_dir)
        if not found:
            raise ConfigError(
                f"train.resume=latest but {checkpoints_dir(run_dir)} holds no complete checkpoint; "
                "set run.dir to the run to resume, or drop --resume"
            )
        damaged = []
        for path in reversed(found):
            problem = checkpoint_problem(path)
            if problem is None:
                if damaged:
                    log.warning("resuming from %s, the newest intact checkpoint; skipped as damaged: %s", path.name,
                                "; ".join(damaged))
                return path
            damaged.append(f"{path.name} ({problem})")
        raise ConfigError(f"every checkpoint in {checkpoints_dir(run_dir)} is damaged: {'; '.join(damaged)}")
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise ConfigError(f"train.resume={resume!r} is not a complete checkpoint directory (no {COMPLETE} file)")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"train.resume={resume!r} is damaged: {problem}; resume from another checkpoint")
    return path


def read_ledger(path: Path) -> dict[int, list[int]]:
    """The job ledger of a complete checkpoint alone (target ranks need nothing else to resume)."""
    state = read_state(path)
    try:
        return {int(e): [int(i) for i in ids] for e, ids in state["ledger"].items()}
    except (ValueError, TypeError):
        raise damaged(Path(path) / "state.json", what="checkpoint state", problem="its job ledger is not ours",
                      fix=state_fix(path), error=ConfigError) from None


def read_step(path: Path) -> int:
    """The optimizer steps a complete checkpoint had done."""
    return int(read_state(path)["step"])


def read_time_spent_s(path: Path) -> float:
    """The training time (seconds, every session) a complete checkpoint had spent; 0 for one that did not say."""
    extra = read_state(path).get("extra") or {}
    return float(extra.get("time_spent_s", 0.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedCheckpoint:
    path: Path
    state: CheckpointState
    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng: dict[str, Any]
    python_random: list[int]


def check_fits(path: Path, *, model_signature: dict[str, Any], data_fingerprint: str) -> dict[str, Any]:
    """The checkpoint's `state.json`, once it is known to fit the config: the same drafter shape, the same data and
    plan settings (else a ConfigError naming the difference)."""
    payload = read_state(path)
    if payload["model_signature"] != model_signature:
        saved = payload["model_signature"]
        diff = {k: (saved.get(k), model_signature.get(k)) for k in sorted(set(saved) | set(model_signature))
                if saved.get(k) != model_signature.get(k)}
        raise ConfigError(
            f"checkpoint {path} is of another model shape (checkpoint vs config: {diff}); "
            "resume with the config it was trained with, or start a new run.dir"
        )
    if payload["data_fingerprint"] != data_fingerprint:
        raise ConfigError(
            f"checkpoint {path} was trained on other data or plan settings; resume with the same data.* "
            "and pipeline.token_budget, or start a new run.dir"
        )
    return payload


def load_checkpoint(path: Path, *, model_signature: dict[str, Any], data_fingerprint: str) -> LoadedCheckpoint:
    payload = check_fits(path, model_signature=model_signature, data_fingerprint=data_fingerprint)
    state = CheckpointState(
        step=payload["step"],
        epoch=payload["epoch"],
        ledger=read_ledger(path),
        model_signature=payload["model_signature"],
        data_fingerprint=payload["data_fingerprint"],
        scheduler=payload["scheduler"],
        extra=payload["extra"],
    )
    weights = load_file(str(path / "drafter.safetensors"))
    # a checkpoint whose marker predates its checksum is not verified on read: damaged weights are named here, not
    # after steps of NaN losses
    check_finite(weights, path / "drafter.safetensors",
                 fix="resume from an earlier checkpoint (train.resume=RUN_DIR/checkpoints/step_N) or delete this one")
    return LoadedCheckpoint(path=path, state=state, weights=weights,
                            optimizer_state=_load_tensors(path / "optimizer.pt"), rng=_load_tensors(path / "rng.pt"),
                            python_random=payload["python_random"])


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointDrafter:
    """A training checkpoint's drafter, as a warm start reads it (`drafter.init_from`)."""

    weights: dict[str, torch.Tensor]
    """The drafter's weights, fp32 on the host: the weight average where the run kept one (what it exported)."""
    variant: str
    """dflash | dflash2 | dspark."""
    tap_layer_ids: tuple[int, ...]


def read_checkpoint_drafter(path: Path) -> CheckpointDrafter:
    """The drafter of the finished training checkpoint `path` (a ConfigError naming a damaged one)."""
    from dflash_trainer.train.ema import PREFIX, split_averaged

    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"drafter.init_from={path} is damaged: {problem}; start from another checkpoint")
    signature = read_state(path)["model_signature"]
    weights = load_file(str(path / "drafter.safetensors"))
    check_finite(weights, path / "drafter.safetensors", fix="start from another checkpoint")
    raw, averaged = split_averaged(weights)
    weights = raw | {k[len(PREFIX):]: v for k, v in averaged.items()}
    return CheckpointDrafter(weights=weights, variant=signature.get("variant", "dflash"),
                             tap_layer_ids=tuple(signature["tap_layer_ids"]))


def _load_tensors(path: Path) -> Any:
    """A `torch.save`d file of tensors and plain containers; anything else (a pickle of arbitrary objects,
    which could run code) is refused, never unpickled."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise ConfigError(f"{path} is not a checkpoint we wrote: it holds objects other than tensors, and loading "
                          "it could run code, so it was not loaded. Resume from another checkpoint") from None
