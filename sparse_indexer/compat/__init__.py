"""Adapters to serving engines. ``sparse_indexer.compat.vllm``: vLLM's workspace manager and indexer op.

Nothing here is imported by ``sparse_indexer`` itself; vLLM is needed only by the callers of the default
``manager=None`` (``vllm.v1.worker.workspace.current_workspace_manager``) and of vLLM's forward context.
"""
