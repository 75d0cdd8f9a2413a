from minisgl.llm.llm import LLM

__all__ = ["LLM"]
