"""`specula serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one `Speculator`.

`create_app` builds the app, `engine` holds the decoding worker behind the `Engine`
interface, `runner` runs it under uvicorn with a graceful shutdown.
"""

from specula.serve.app import ServeSettings, create_app
from specula.serve.engine import BatchedEngine, Engine, GenerationRequest, RequestStream
from specula.serve.runner import running_server, serve

__all__ = ["Engine", "GenerationRequest", "RequestStream", "ServeSettings", "BatchedEngine", "create_app",
           "running_server", "serve"]
