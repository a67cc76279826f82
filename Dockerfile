# One image for every role in docker-compose.yml: a talosd node, or a
# talos-proxy serving an MCP tool. Built from this repository only.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY talos_sdk ./talos_sdk
COPY talos ./talos
COPY mcp_proxy ./mcp_proxy
RUN pip install --no-cache-dir . mcp-server-time
COPY deploy/entrypoint.sh /usr/local/bin/talos-entrypoint
RUN chmod +x /usr/local/bin/talos-entrypoint && useradd -m talos
USER talos
ENTRYPOINT ["talos-entrypoint"]
