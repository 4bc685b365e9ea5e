import pytest_asyncio

from omnistage.engine.async_omni import AsyncOmni


@pytest_asyncio.fixture(scope="module")
async def tiny_omni():
    """tiny-omni in real stage processes, shared by a module's tests."""
    engine = AsyncOmni.from_pipeline("tiny-omni", enable_sleep_mode=True)
    try:
        yield engine
    finally:
        engine.shutdown()
