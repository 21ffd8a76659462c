# Sourced by the Makefile targets: offline operation and the bundled benchmark data when it is beside the checkout.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TRANSFORMERS_VERBOSITY=${TRANSFORMERS_VERBOSITY:-error}
if [ -z "${KVSCOPE_DATA_DIR:-}" ] && [ -d "$(dirname "${BASH_SOURCE[0]}")/../../shared/data" ]; then
  export KVSCOPE_DATA_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../shared/data" && pwd)"
fi
