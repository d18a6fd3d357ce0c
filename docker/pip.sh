#!/bin/sh
# pip inside an image build: a CA bundle and a pip configuration given as build secrets (never a layer) are used
# while this one step runs; without them pip uses the image's own CA certificates and pip's defaults.
set -e
[ -s /run/secrets/pipca ] && export PIP_CERT=/run/secrets/pipca
[ -s /run/secrets/pipconf ] && export PIP_CONFIG_FILE=/run/secrets/pipconf
cmd="$1"; shift; exec /opt/feduq/bin/python -m pip "$cmd" --no-cache-dir "$@"
