# A slim image for the DaemonSet. NVML (libnvidia-ml.so.1) is not in the image: the NVIDIA container
# runtime injects the host driver's copy (NVIDIA_DRIVER_CAPABILITIES=utility in daemonset.yaml).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY rules ./rules
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
# Root with every capability dropped but SYSLOG (set in the DaemonSet): /dev/kmsg needs it.
USER 0
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["gpu-health-agent"]
CMD ["run"]
