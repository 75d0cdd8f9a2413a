from minisgl.llm.llm import LLM
from minisgl.llm.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput"]
