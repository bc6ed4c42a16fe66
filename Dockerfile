# kvgate: the proxy, the simulated backend and the bundled tokenizer in one slim image.
# Stage 1 builds the wheel; stage 2 installs exactly that wheel, as users install kvgate.
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY proxy ./proxy
COPY policies ./policies
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY --from=build /wheels /wheels
# /app/models/qwen3-14b is the installed package's bundled model, so the configs in
# /app/deploy resolve their paths (../models/qwen3-14b) as they do in the repo.
RUN pip install --no-compile /wheels/kvgate-*.whl \
    && rm -rf /wheels \
    && mkdir -p /app/models \
    && ln -s "$(python -m proxy.bundled)" /app/models/qwen3-14b \
    && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin kvgate
COPY deploy ./deploy

USER kvgate
EXPOSE 8080
# /healthz answers while the process serves; /readyz adds backends and the ledger.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVGATE_PORT', '8080') + '/healthz', timeout=2)"]
ENTRYPOINT ["kvgate"]
CMD ["serve", "--config", "/app/deploy/kvgate-sim.toml"]
