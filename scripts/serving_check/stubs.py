"""Import stubs for what the engines import but cannot run on this CPU; each is named with its reason.

- `torchvision`: `sglang.srt.configs` imports every model config at import time, and two of them (InternVL's
  `multimodal/internvl_utils.py`, `configs/deepseek_ocr.py`) import torchvision for image preprocessing. vLLM's
  `qwen3_vl.py` (the image case's target) imports transformers' Qwen2-VL image processor
  (`image_processing_qwen2_vl.py`), which imports torchvision; the check hands the target its patches, made by our
  data code, and never runs that processor. The registry's torchvision wheels are CUDA builds (their `_C.so` needs
  `libtorch_cuda.so`), which do not load with a CPU torch. Nothing of DFlash touches it.

The stub serves these imports to the named importers only (SGLang's own modules; transformers' Qwen2-VL image
processor). Anything else that asks (transformers probes `importlib.util.find_spec("torchvision")` to decide whether
to use it) still finds no module. Every name read from the stub is a class that raises when used, so a stubbed code
path fails loudly instead of computing something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = {"torchvision": "the registry's wheels are CUDA builds; the engines import it for image preprocessing only"}


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {"__module__": cls.__module__})


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is a serving-check stub: "
                           f"{STUBBED[type(self).__module__.split('.')[0]]}")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {"__module__": self.__name__})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, importers: tuple[str, ...]):
        self.importers = importers

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in STUBBED or not _importer().startswith(self.importers):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _importer() -> str:
    """The module whose code asked for the import: the first frame outside importlib."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                 or frame.f_globals.get("__name__", "").startswith("importlib")):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def install_for_sglang() -> None:
    sys.meta_path.insert(0, _StubFinder(("sglang", *STUBBED)))


def install_for_vllm() -> None:
    sys.meta_path.insert(0, _StubFinder(("transformers.models.qwen2_vl.image_processing_qwen2_vl", *STUBBED)))
