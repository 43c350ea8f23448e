"""vLLM's entry point: ``"kv_connector_module_path": "kvtier_async.vllm"`` with
``"kv_connector": "KVTierConnector"``. Importing this module needs vLLM installed."""

from kvtier_async.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
