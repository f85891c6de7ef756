"""Which targets the serving engines can verify a DFlash drafter with.

An engine serves a DFlash drafter only for a target model class that can hand it the tapped hidden states:
vLLM's classes that implement its EAGLE-3 interface (`SupportsEagle3`), SGLang's that define
`set_dflash_layers_to_capture`. These lists were read from the released packages (vLLM 0.33.0, SGLang 0.5.23;
registry architectures whose class has the interface, itself or through a base class; draft-model and embedding
classes left out). Gemma 3, for one, is in neither. SGLang's list leaves out `Qwen3VLForConditionalGeneration`: its
`set_dflash_layers_to_capture` calls the method on its language model (`Qwen3LLMModel`), which has none, so SGLang's
model runner raises AttributeError setting DFlash up (the serving check's image case). Newer releases add classes: a
target missing here gets a warning, not a refusal.

An image-text target whose layers rotate by M-RoPE positions (Qwen3-VL) is served right by vLLM's V2 model runner
only (`warn_if_mrope`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

CHECKED = {"vLLM": "0.33.0", "SGLang": "0.5.23"}
"""The engine releases the lists below were read from."""

VLLM_VERIFIERS = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "Cosmos3ForConditionalGeneration",
    "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "GptOssForCausalLM", "GraniteForCausalLM",
    "GraniteMoeForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteSWAForCausalLM",
    "IQuestCoderForCausalLM", "InternLM3ForCausalLM", "K2HorizonForCausalLM", "KimiK25ForConditionalGeneration",
    "LagunaForCausalLM", "Llama4ForCausalLM", "Llama4ForConditionalGeneration", "LlamaForCausalLM",
    "LlavaForConditionalGeneration", "MiMoForCausalLM", "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM",
    "MiMoV2OmniForCausalLM", "MiniCPM3ForCausalLM", "MiniCPMForCausalLM", "MiniMaxM2ForCausalLM",
    "Ministral3ForCausalLM", "MistralForCausalLM", "MistralLarge3ForCausalLM", "MuseGlimmerForCausalLM",
    "MuseGlimmerForConditionalGeneration", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
    "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2", "NemotronH_Omni_Reasoning_V3",
    "NemotronH_Super_Omni_Reasoning_V3", "OpenCUAForConditionalGeneration", "Phi3ForCausalLM",
    "PixtralForConditionalGeneration", "Plamo3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3VLForConditionalGeneration", "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "SarvamMLAForCausalLM", "Step1ForCausalLM",
    "TeleChat2ForCausalLM", "TeleChat3ForCausalLM", "TeleFLMForCausalLM"
})

SGLANG_VERIFIERS = frozenset({
    "Cosmos3ForConditionalGeneration", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration", "Glm4MoeLiteForCausalLM", "Glm5NextForConditionalGeneration",
    "GlmMoeDsaForCausalLM", "GptOssForCausalLM", "IQuestCoderForCausalLM", "InternLM3ForCausalLM",
    "InternS1ProForConditionalGeneration", "InternS2MobiusForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration", "KimiK25ForConditionalGeneration",
    "KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM", "LagunaForCausalLM", "Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration", "Llama4ForCausalLM", "LlamaForCausalLM",
    "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
    "Ministral3ForCausalLM", "MistralForCausalLM", "MistralLarge3ForCausalLM", "MuseGlimmerForCausalLM",
    "MuseGlimmerForConditionalGeneration", "MuseSparkForConditionalGeneration", "NanbeigeForCausalLM",
    "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "NemotronH_Nano_Omni_Reasoning_V3",
    "NemotronH_Nano_VL_V2", "NemotronH_Omni_Reasoning_V3", "Phi3ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen4ExpForConditionalGeneration",
    "TeleFLMForCausalLM"
})

log = logging.getLogger(__name__)

_VERIFIERS = {"vLLM": VLLM_VERIFIERS, "SGLang": SGLANG_VERIFIERS}


def model_classes(config: dict) -> list[str]:
    """The model classes a config is served as: its `architectures`, else the class transformers maps its model
    type to (a multimodal config, one with a `text_config`, as image-text-to-text, not its language model)."""
    if config.get("architectures"):
        return list(config["architectures"])
    mappings = (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for mapping in mappings if config.get("text_config") else mappings[1:]:
        if config.get("model_type") in mapping:
            return [mapping[config["model_type"]]]
    return []


def engines_without_support(target_config: Optional[Any]) -> list[str]:
    """The engines (`"vLLM 0.33.0"`, ...) whose checked release has no DFlash verifier for the target's model
    class; empty when both have one, or when the class is unknown (no config, no architectures)."""
    if target_config is None:
        return []
    config = target_config if isinstance(target_config, dict) else target_config.to_dict()
    classes = model_classes(config)
    if not classes:
        return []
    return [f"{name} {CHECKED[name]}" for name, known in _VERIFIERS.items() if not set(classes) & known]


def warn_if_unserved(target_config: Optional[Any]) -> None:
    """Log a warning naming the engines that cannot serve a drafter of this target (their checked release)."""
    missing = engines_without_support(target_config)
    if missing:
        config = target_config if isinstance(target_config, dict) else target_config.to_dict()
        log.warning("the target's model class %s has no DFlash verifier in %s (no hidden-state capture for "
                    "drafters): these engines cannot serve this drafter; the DFlash reference code "
                    "(`dflash`) and `dflash-train eval` can", "/".join(model_classes(config)), " or ".join(missing))


def warn_if_mrope(target_config: Optional[Any]) -> None:
    """Log a warning for a target whose layers rotate by M-RoPE positions (an image-text target: Qwen3-VL). The
    drafter rotates by sequence positions, as vLLM's V2 model runner hands them (`input_batch.positions`); its V1 runner
    hands the drafter the first row of the target's M-RoPE positions instead (`_copy_and_expand_dflash_inputs` reads
    the (3, N) buffer as one row), which after an image fall behind the sequence positions, and stores the drafter's
    context at them."""
    if target_config is None:
        return
    config = target_config if isinstance(target_config, dict) else target_config.to_dict()
    text = config.get("text_config") or config
    if "mrope_section" in (text.get("rope_parameters") or text.get("rope_scaling") or {}):
        log.warning("the target places image tokens by M-RoPE positions: serve this drafter with vLLM's V2 model "
                    "runner, its default where Triton runs, which hands it sequence positions as training did; its "
                    "V1 runner (VLLM_USE_V2_MODEL_RUNNER=0) hands it the target's M-RoPE positions, behind the "
                    "sequence positions after an image, and drafts image prompts from a misplaced context")
