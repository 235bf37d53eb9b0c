# A slim image for the DaemonSet. NVML (libnvidia-ml.so.1) is not in the image: the NVIDIA container
# runtime injects the host driver's copy (NVIDIA_DRIVER_CAPABILITIES=utility in daemonset.yaml).
# The storm path (agent/hot_path.py) is compiled with mypyc here, which needs a C compiler; the runtime
# stage has none. `gpu-health-agent --version` says whether the modules it runs are compiled.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY rules ./rules
COPY scripts/compile-hot-path ./scripts/
# The agent and its dependencies go to /install whatever this stage already has (--ignore-installed: pip
# would otherwise leave out every dependency the compile step installed here).
RUN pip install --no-cache-dir ".[compile]" \
    && python scripts/compile-hot-path /src \
    && pip install --no-cache-dir --ignore-installed --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
# The runtime stage itself must import the agent and run its storm path compiled.
RUN gpu-health-agent --version | grep -q "compiled with mypyc"
# Root with every capability dropped but SYSLOG (set in the DaemonSet): /dev/kmsg needs it.
USER 0
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["gpu-health-agent"]
CMD ["run"]
