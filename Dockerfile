# A slim image for the DaemonSet. NVML (libnvidia-ml.so.1) is not in the image: the NVIDIA container
# runtime injects the host driver's copy (NVIDIA_DRIVER_CAPABILITIES=utility in daemonset.yaml).
# The storm path (agent/hot_path.py) is compiled with mypyc here, which needs a C compiler; the runtime
# stage has none. `gpu-health-agent --version` says whether the modules it runs are compiled.
# scripts/build-image builds this same file without Docker or a registry (the real-node tests run its image),
# over bases made locally from Debian packages: BUILD_BASE and BASE are its arguments.
ARG BUILD_BASE=python:3.11-slim
ARG BASE=python:3.11-slim
FROM ${BUILD_BASE} AS build
# Reproducible builds (docs/release.md): the commit's time, so the wheel and the bytecode are the same bytes.
ARG SOURCE_DATE_EPOCH
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY agent ./agent
COPY rules ./rules
# Every Python package of the build and of the image, pinned with its hashes (scripts/lock-image).
COPY lock/python-build.txt lock/python-runtime.txt ./lock/
COPY scripts/compile-hot-path scripts/install-agent ./scripts/
# The storm path compiled in /src, then the agent and its dependencies into their own virtualenv.
RUN scripts/install-agent /src /opt/gpu-health-agent

FROM ${BASE}
COPY --from=build /opt/gpu-health-agent /opt/gpu-health-agent
# The runtime stage itself must import the agent and run its storm path compiled.
RUN /opt/gpu-health-agent/bin/gpu-health-agent --version | grep -q "compiled with mypyc"
# Root with every capability dropped but SYSLOG (set in the DaemonSet): /dev/kmsg needs it.
USER 0
ENV PATH=/opt/gpu-health-agent/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["gpu-health-agent"]
CMD ["run"]
