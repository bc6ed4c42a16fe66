# kvgate: the proxy, the simulated backend and the bundled tokenizers in one slim image.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY policies ./policies
COPY models ./models
COPY deploy ./deploy
RUN pip install --no-compile . \
    && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin kvgate \
    && chown -R kvgate /app

USER kvgate
EXPOSE 8080
# /healthz answers while the process serves; /readyz adds backends and the ledger.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVGATE_PORT', '8080') + '/healthz', timeout=2)"]
ENTRYPOINT ["kvgate"]
CMD ["serve", "--config", "/app/deploy/kvgate-sim.toml"]
