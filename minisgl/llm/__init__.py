from minisgl.llm.embed import EmbeddingOutput, EmbeddingRequestOutput
from minisgl.llm.llm import LLM
from minisgl.llm.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "EmbeddingOutput", "EmbeddingRequestOutput", "CompletionOutput", "Logprob", "RequestOutput"]
