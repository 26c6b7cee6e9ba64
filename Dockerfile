# tokenweir gateway: slim, non-root, starts on its embedded default policy.
#   docker build -t tokenweir .                       (optional: --build-arg EXTRAS=otel,local-embed)
#   docker run -p 8080:8080 -e TOKENWEIR_API_KEY=my-app-key \
#     -e TOKENWEIR_BACKEND_URL=http://my-vllm:8000/v1 tokenweir
# The default policy reads TOKENWEIR_API_KEY, TOKENWEIR_BACKEND_URL, TOKENWEIR_BACKEND_KEY and
# TOKENWEIR_LEDGER (see proxy/policies/default.yaml); mount your own policy over
# /etc/tokenweir/policy.yaml. Usage records go to the volume /var/lib/tokenweir.
# The same image runs the other commands: `docker run tokenweir mock-backend --host 0.0.0.0`.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY proxy ./proxy
COPY policies ./policies
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENWEIR_LEDGER=sqlite:////var/lib/tokenweir/tokenweir.db \
    HOME=/var/lib/tokenweir
# The data directory's group is 0 and has the owner's rights: a platform that runs the image as
# an arbitrary UID in group 0 (OpenShift's restricted policy, `docker run --user 12345:0`) can
# write the ledger and caches there too. HOME points there for such a UID, which has no passwd
# entry (and would get HOME=/, not writable: Hugging Face's cache lives under HOME).
RUN useradd --system --uid 10001 --home-dir /var/lib/tokenweir --shell /usr/sbin/nologin tokenweir \
    && install -d -o tokenweir -g 0 -m 0770 /var/lib/tokenweir
# Dependencies in layers of their own, read from pyproject.toml: a change to the code rebuilds
# only the last, small layer, and images with and without extras share the first.
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import sys, tomllib; project = tomllib.load(open(sys.argv[1], 'rb'))['project']; \
print('\n'.join(project['dependencies']))" /tmp/pyproject.toml >/tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt
# Extras to install, comma-separated: otel, local-embed (an unknown name fails the build).
ARG EXTRAS=""
RUN python -c "import sys, tomllib; extras = tomllib.load(open(sys.argv[1], 'rb'))['project']['optional-dependencies']; \
print('\n'.join(d for name in sys.argv[2].split(',') if name for d in extras[name]))" /tmp/pyproject.toml "$EXTRAS" >/tmp/extras.txt \
    && if [ -s /tmp/extras.txt ]; then pip install --no-cache-dir -r /tmp/extras.txt; fi \
    && rm /tmp/extras.txt /tmp/pyproject.toml
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
COPY policies/default.yaml /etc/tokenweir/policy.yaml
WORKDIR /var/lib/tokenweir
# Declared after the directory is made and owned, so a new volume starts owned by tokenweir.
VOLUME ["/var/lib/tokenweir"]
USER 10001:10001
EXPOSE 8080
# Asks the port and route of whatever PID 1 was started as (`serve --port N`: /healthz on N,
# default 8080; `mock-backend --port N`: /v1/models on N, default 8000). The port is read as
# the command's own parser reads it, `--port N` or `--port=N` (also under `docker run --init`).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 CMD ["python", "-c", "\
import argparse, sys, urllib.request\n\
argv = open('/proc/1/cmdline', 'rb').read().decode().split('\\0')\n\
mock = 'mock-backend' in argv\n\
flags = argparse.ArgumentParser(add_help=False)\n\
flags.add_argument('--port')\n\
port = flags.parse_known_args([a for a in argv if a != '--'])[0].port or ('8000' if mock else '8080')\n\
path = '/v1/models' if mock else '/healthz'\n\
sys.exit(urllib.request.urlopen(f'http://127.0.0.1:{port}{path}', timeout=2).status != 200)\n\
"]
# Exec form: tokenweir is PID 1 and gets SIGTERM itself (`docker stop`), drains open streams
# (server.drain_timeout) and exits 0 before the engine's kill.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenweir"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080", "--config", "/etc/tokenweir/policy.yaml"]
