"""minisgl: a compact, fast LLM inference engine with an OpenAI-compatible server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    from minisgl.llm.outputs import CompletionOutput, Logprob, RequestOutput

_OUTPUTS = ("CompletionOutput", "Logprob", "RequestOutput")


def __getattr__(name: str) -> Any:
    # Lazy so that `import minisgl.message` in the API server never pulls in torch.
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    if name == "SamplingParams":
        from minisgl.core import SamplingParams

        return SamplingParams
    if name in _OUTPUTS:
        from minisgl.llm import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
