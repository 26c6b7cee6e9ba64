# tokenweir gateway: slim, non-root, with a health check.
#   docker build -t tokenweir .
#   docker run -p 8080:8080 -v $PWD/my-policy.yaml:/etc/tokenweir/policy.yaml:ro tokenweir
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY policies ./policies
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin tokenweir
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY policies/default.yaml /etc/tokenweir/policy.yaml
USER tokenweir
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["tokenweir", "serve", "--host", "0.0.0.0", "--port", "8080", "--config", "/etc/tokenweir/policy.yaml"]
