# One Dockerfile for every stage image; the build context (made by `make images`) holds this
# image's requirements.lock, exactly its wheels in wheels/, and any Debian packages in debs/.
# Nothing is fetched during the build: pip runs with --no-index --require-hashes.
# Works with the legacy builder (no BuildKit features).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE} AS venv
# Lets build-image.sh remove this throw-away stage after the build.
LABEL org.g4v69.build-stage=venv
COPY requirements.lock /build/requirements.lock
COPY wheels/ /build/wheels/
# The one sdist-only dependency builds with setuptools from wheels/ (pip's isolated build env).
# SOURCE_DATE_EPOCH makes the byte-compiled .pyc files hash-based instead of stamped with the time of
# extraction, so two builds from the same lock install byte-identical files.
RUN export SOURCE_DATE_EPOCH=0 && python3 -m venv /opt/venv \
 && PIP_NO_INDEX=1 PIP_FIND_LINKS=/build/wheels /opt/venv/bin/pip install --no-cache-dir \
      --disable-pip-version-check --no-deps --require-hashes -r /build/requirements.lock \
 && /opt/venv/bin/pip check

FROM ${BASE_IMAGE}
COPY debs/ /build/debs/
RUN if ls /build/debs/*.deb >/dev/null 2>&1; then dpkg -i /build/debs/*.deb; fi && rm -rf /build
COPY --from=venv /opt/venv /opt/venv
# The g4v69 package is not baked in: the work tree is mounted at run time and put on PYTHONPATH,
# so the image holds only locked dependencies and its tag can derive from the lock alone.
RUN printf '#!/bin/sh\nexec /opt/venv/bin/python3 -m stages "$@"\n' > /usr/local/bin/g4v69 \
 && chmod 755 /usr/local/bin/g4v69
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    LANG=C.UTF-8
ARG IMAGE_NAME=unknown
ARG LOCK_SHA256=unknown
LABEL org.g4v69.image=${IMAGE_NAME} org.g4v69.lock-sha256=${LOCK_SHA256}
CMD ["g4v69", "--help"]
