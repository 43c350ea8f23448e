"""The vLLM face: `KVTierConnector`, loaded by vLLM through ``kv_connector_module_path``."""
