"""Our export in SGLang's DFlash drafter (sglang 0.5.23, `srt/models/dflash.py`), through SGLang's own code:

- config and loading: `ModelConfig.from_server_args(..., is_draft_model=True)` and `get_model` (its
  `DefaultModelLoader`, model registry and `DFlashDraftModel.load_weights` on the export's safetensors), as its
  draft worker loads `--speculative-draft-model-path EXPORT`;
- target layers: `parse_dflash_draft_config(...).resolve_target_layer_ids` (what its model runner passes on), given
  to the target, loaded with SGLang's loader, by its model runner's `configure_aux_hidden_state_capture` (which calls
  the target class's `set_dflash_layers_to_capture`; Qwen3's adds 1: it captures before a layer). A target that
  cannot capture them (SGLang 0.5.23's Qwen3-VL, image_case.py) is a `refused` result;
- context: `project_target_hidden` (fc, hidden_norm), then the draft worker's own
  `DFlashWorkerV2._append_target_hidden_sequential` (per layer K/V projection, k_norm, RoPE), capturing what it
  writes to the KV pool;
- block: `DFlashDraftModel.forward` with the block embedded by the target's embedding, as the worker does; logits
  through the target's LM head (the worker's greedy path); DFlash2: the worker's own `_selector_lattice` (the
  candidates from the target's LM head, then the selector's scores) on slots 1..B-1. Its torch.compile'd functions
  (`_grouped_conv`, `_score_edges`) compile and run on the CPU as they are. LiLiCorr: the worker's
  `lilicorr_candidates`, the head's scores and `propose_lilicorr_block` (greedy, its torch walk), anchored on the
  last context row (`publish_anchor`).

Substitutions, each for a reason:
1. attention kernel: each layer's `RadixAttention.forward` is `attention.attend` (SDPA over the captured context and
   the block) with the layer's own `attn_type` (DECODER = causal) and `sliding_window_size` (a window's left
   reach); SGLang's backends (FlashInfer, FA3, Triton) need a GPU.
2. torchvision: stubbed for SGLang's imports (see stubs.py).
3. SGLang refuses DFLASH on a CPU device in its server-args hook (`_handle_dflash`), before any model code runs:
   the check publishes server args for the target alone (device cpu) and loads the draft model config itself, as
   the draft worker does with `--speculative-draft-model-path`. The worker's fused context kernel (Triton) is not
   used; its sequential path, the one it falls back to, is.
SGLang does not read the speculators format: its config fails in `AutoConfig` (no `model_type`); the check tries
and reports the error as "not read by this engine".
"""

from __future__ import annotations

import tempfile
import types

import torch

from serving_check.attention import attend
from serving_check.jobs import EngineResult, Job

_READY = False


class NotRead(Exception):
    """The engine does not read this export format."""


def _setup(target: str):
    """Server args for the target, published, and one-process distributed groups (once per process)."""
    global _READY
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=target, device="cpu", dtype="float32", skip_tokenizer_init=True)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))  # re-publish per job: last one wins
    if not _READY:
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp(prefix='sglang-dist-')}")
        initialize_model_parallel()
        _READY = True
    return args


def _load(job: Job, args):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    try:
        config = ModelConfig.from_server_args(args, model_path=job.export, is_draft_model=True)
    except Exception as e:
        if job.format == "speculators":
            first_line = str(e).splitlines()[0].replace(job.export, "EXPORT") if str(e) else ""
            raise NotRead(f"{type(e).__name__}: {first_line}") from e
        raise
    return config, get_model(model_config=config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))


class CannotServe(Exception):
    """The engine cannot serve the drafter with this target."""


def _target_taps(args, draft_config, dspark: bool) -> list[int]:
    """The target layers SGLang feeds the drafter, in our numbering (output of layer l): the target loaded with
    SGLang's loader and told which layers to capture by its model runner's own `configure_aux_hidden_state_capture`
    (with the ids of `parse_dflash_draft_config(...).resolve_target_layer_ids`). CannotServe when that raises."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    from sglang.srt.model_loader import get_model
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    config = ModelConfig.from_server_args(args)
    target = get_model(model_config=config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    ids = parse_dflash_draft_config(draft_hf_config=draft_config).resolve_target_layer_ids(
        target_num_layers=int(config.hf_text_config.num_hidden_layers),
        draft_num_layers=int(draft_config.num_hidden_layers))
    try:
        configure_aux_hidden_state_capture(model=target, eagle_use_aux_hidden_state=False,
                                           eagle_aux_hidden_state_layer_ids=None, dflash_use_aux_hidden_state=True,
                                           dflash_target_layer_ids=ids, is_dspark=dspark)
    except Exception as e:
        raise CannotServe(f"{type(target).__name__}: capturing layers {ids} for DFlash raises {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from e
    return [i - 1 for i in sorted(target.model.layers_to_capture)]  # captured before layer i = output of i - 1


def _replace_attention(model, inputs: dict, captured: dict) -> None:
    """Substitution 1."""
    for layer in model.layers:
        radix = layer.self_attn.attn

        def forward(q, k, v, forward_batch=None, save_kv_cache=True, radix=radix, **kwargs):
            window = radix.sliding_window_size
            return attend(q, k, v, context_k=captured[radix.layer_id][0], context_v=captured[radix.layer_id][1],
                          q_pos=inputs["block_positions"], context_pos=inputs["context_positions"],
                          num_heads=radix.tp_q_head_num, num_kv_heads=radix.tp_k_head_num, head_dim=radix.head_dim,
                          scale=radix.scaling, causal=radix.attn_type.value == "decoder",
                          window_left=None if window is None or window < 0 else window)

        radix.forward = forward


def run(job: Job, out_file: str) -> EngineResult:
    from serving_check.cases import read_target
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2, _selector_lattice

    args = _setup(job.target)
    try:
        model_config, model = _load(job, args)
    except NotRead as e:
        return EngineResult(job=job.id, engine="sglang", status="not-read", detail=str(e))
    try:
        taps = _target_taps(args, model_config.hf_config, dspark=job.variant == "dspark")
    except CannotServe as e:
        return EngineResult(job=job.id, engine="sglang", status="refused", detail=str(e),
                            model_class=type(model).__name__)
    inputs = torch.load(job.inputs)
    target = read_target(job.target)
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_kv_buffer(layer, _loc, k, v, *_scales):
        captured[layer.layer_id] = (k.clone(), v.clone())  # (C, nkv, hd): k_norm and RoPE applied

    worker = types.SimpleNamespace(  # the draft worker's attributes its context path reads
        draft_model=model,
        draft_model_runner=types.SimpleNamespace(token_to_kv_pool=types.SimpleNamespace(set_kv_buffer=set_kv_buffer)))
    _replace_attention(model, inputs, captured)
    positions = inputs["context_positions"]
    with torch.no_grad():
        if job.variant == "dspark":  # its worker's injector: fc + hidden_norm, then each layer's K/V into the pool
            model.write_target_hidden_kv(target_hidden=inputs["taps"], pool=_CapturePool(set_kv_buffer),
                                         positions=positions, cache_loc=positions.clone())
        else:
            context = model.project_target_hidden(inputs["taps"])  # fc + hidden_norm: (C, H)
            DFlashWorkerV2._append_target_hidden_sequential(worker, ctx_hidden=context, ctx_positions=positions,
                                                            ctx_cache_loc=positions.clone())
        out = model(inputs["block_ids"], inputs["block_positions"], None,
                    input_embeds=target.embed[inputs["block_ids"]])
        hidden = out.hidden_states  # (B, H)
        outputs = {"hidden": hidden, "logits": hidden @ target.head.T}
        if job.variant == "dflash2":  # the draft worker's selector pass on the drafted slots 1..B-1
            model.lm_head = _lm_head(target.head)  # the worker attaches the target's LM head
            outputs["candidates"], lattice = _selector_lattice(model, hidden[None, 1:], inputs["block_ids"][:1])
            outputs["candidates"], outputs["lattice"] = outputs["candidates"][0], lattice[0]
        elif job.variant.startswith("lilicorr"):
            outputs.update(_lilicorr(model, hidden, context, target))
        if job.variant == "dspark":
            model.lm_head = _lm_head(target.head)  # the worker attaches the target's LM head
            outputs |= _markov_walk(model, hidden, inputs["block_ids"][:1])
    torch.save(outputs, out_file)
    return EngineResult(job=job.id, engine="sglang", status="ran", model_class=type(model).__name__,
                        layers=[_layer_mode(layer.self_attn.attn) for layer in model.layers],
                        taps=taps, block_size=model.block_size, outputs=out_file)


class _CapturePool:
    """The draft KV pool as DSpark's `write_target_hidden_kv` writes it: `set_kv_buffer(layer, loc, k, v, ...)`."""

    def __init__(self, set_kv_buffer):
        self.set_kv_buffer = set_kv_buffer


def _markov_walk(model, hidden: torch.Tensor, anchor: torch.Tensor) -> dict:
    """The draft worker's greedy `draft_markov_block` over `compute_base_logits` (one request: the block's B slots),
    and the scores each pick was made from: the base logits plus its Markov head's `step_bias` of the previous pick."""
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftNoise, draft_markov_block

    base, _ = model.compute_base_logits(hidden)  # (B, V)
    sync = types.SimpleNamespace(sync=lambda site, tokens: tokens)  # one rank: nothing to agree on
    drafts, _ = draft_markov_block(markov_head=model.markov_head, base_logits=base[None], anchor_tokens=anchor,
                                   draft_hidden=None, step_temperatures=torch.zeros(1),
                                   noise=DraftNoise(key=0, offset=torch.zeros(1, dtype=torch.int64)), tp_sync=sync,
                                   greedy_draft=True)
    previous = torch.cat([anchor, drafts[0, :-1]]).long()  # (B,) the token before each slot
    bias, _ = model.markov_head.step_bias(previous, hidden_states=None, state=None)
    return {"drafts": drafts[0], "scores": base + bias}


def _lilicorr(model, hidden: torch.Tensor, context: torch.Tensor, target) -> dict:
    """The draft worker's LiLiCorr pass on the drafted slots 1..B-1, anchored as `publish_anchor` anchors it (the
    last row of `project_target_hidden`): `lilicorr_candidates`, the head's `score` and `log_factors` (the lattice
    its walk reads) and `propose_lilicorr_block` (its greedy path: the picks)."""
    from sglang.kernels.ops.speculative.lilicorr import _lattice_scores
    from sglang.srt.speculative.lilicorr_utils import lilicorr_candidates, propose_lilicorr_block

    head, lm_head = model.lilicorr, _lm_head(target.head)
    embed = torch.nn.Embedding.from_pretrained(target.embed)  # the target's input embedding, as the worker's
    anchor = context[-1:]  # (1, H)
    log_probs, candidates = lilicorr_candidates(hidden_states=hidden[1:], lm_head=lm_head, topk=head.candidate_topk)
    start, pair = head.log_factors(*head.score(
        token_embeddings=embed(candidates)[None, None], candidate_log_probs=log_probs[None, None],
        pass_hidden=hidden[None, None, 1:], anchor_hidden=anchor[None], anchor_valid=torch.ones(1, 1, dtype=torch.bool)))
    picks, _, _ = propose_lilicorr_block(head=head, draft_hidden=hidden[None], lm_head=lm_head, embed_tokens=embed,
                                         anchor=anchor)
    return {"candidates": candidates, "lattice": _lattice_scores(start[:, 0], pair[:, 0])[0], "picks": picks[0]}


def _lm_head(weight: torch.Tensor):
    """SGLang's LM head module holding the target's weight (V, H)."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(weight.shape[0], weight.shape[1])
    head.weight_loader(head.weight, weight)
    return head


def _layer_mode(radix) -> dict:
    """A RadixAttention's causality (DECODER = causal) and window (HF's: SGLang keeps its left reach, window - 1)."""
    left = radix.sliding_window_size
    return {"causal": radix.attn_type.value == "decoder", "window": None if left is None or left < 0 else left + 1}
