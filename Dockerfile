# The project image: `rollout` (workers, feeder, trainer, simulator) plus the
# sglang-router wheel, so the compose `sim` profile runs the real router on a laptop.
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

# Dependencies first (cached while only the code changes), then the project.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['router']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

COPY . .
RUN pip install --no-deps . && rollout --help > /dev/null

RUN useradd --create-home --uid 1000 rollout
USER rollout

CMD ["rollout", "--help"]
