# Sourced by the scripts: offline Hugging Face, quiet tokenizers, and the allocator the `posttrain` command preloads
# (tcmalloc, else jemalloc, when installed; POSTTRAIN_ALLOCATOR=system keeps glibc malloc), so that python -m pytest
# and the benchmarks run with it too. Threads are left to each program (the benchmarks use one).
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ "${POSTTRAIN_ALLOCATOR:-}" != "system" ]; then
  for lib in /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib/*/libtcmalloc.so.4 /usr/lib/*/libjemalloc.so.2; do
    if [ -e "$lib" ]; then
      case ":${LD_PRELOAD:-}:" in *":$lib:"*) ;; *) export LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD:}$lib" ;; esac
      break
    fi
  done
fi
