"""Shared test configuration. Nothing global is registered yet.

Open task groups and cancel scopes in test bodies, not across a fixture's ``yield``:
pytest-asyncio runs fixture setup and teardown in separate tasks.
"""
