"""The OpenAI- and Anthropic-compatible HTTP server over one Engine (`ninfer-serve`, `python -m ninfer_jax.server`).

`app.create_app(engine)` builds the FastAPI app; `cli.main` is the command; `serving.OrderlyServer` runs it
under uvicorn with the orderly stop; `subprocess_server.ServerProcess` runs the command as a child process.
"""
