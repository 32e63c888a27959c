# Sourced by scripts/setup.sh (bash): how Horovod's NCCL operations are built and checked, so that they use the
# NCCL torch loads.
#
# horovod_nccl_env NCCL_DIR
#   Exports the variables of a Horovod build with NCCL operations against NCCL_DIR (include/nccl.h,
#   lib/libnccl.so.2): HOROVOD_GPU_OPERATIONS=NCCL, HOROVOD_NCCL_HOME, HOROVOD_NCCL_INCLUDE, HOROVOD_NCCL_LIB and
#   HOROVOD_NCCL_LINK=SHARED. Horovod 0.28.1's FindNCCL.cmake links NCCL statically unless told SHARED, and looks
#   for libnccl_static.a under the CUDA toolkit and the system library folders too: with only HOROVOD_NCCL_HOME it
#   takes the headers from NCCL_DIR but the static library of any other NCCL it finds (the CUDA devel images ship
#   one), so Horovod would run a second, different NCCL beside torch's. Makes lib/libnccl.so (pip's nvidia-nccl
#   ships only libnccl.so.2; the linker wants the unversioned name). Returns 1 with one line when NCCL_DIR lacks
#   the header or the library.
#
# horovod_nccl_check SO_FILE
#   Returns 0 when SO_FILE needs libnccl.so.2 from the dynamic loader (so it shares the one torch loaded) and
#   defines no NCCL function of its own; otherwise 1 with one line.
horovod_nccl_env() {
  local dir=$1 lib
  [ -f "$dir/include/nccl.h" ] || { echo "no NCCL header $dir/include/nccl.h" >&2; return 1; }
  lib=$(ls "$dir"/lib/libnccl.so.* 2>/dev/null | head -1)
  [ -n "$lib" ] || { echo "no NCCL library $dir/lib/libnccl.so.*" >&2; return 1; }
  [ -e "$dir/lib/libnccl.so" ] || ln -sf "$(basename "$lib")" "$dir/lib/libnccl.so"
  export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$dir" HOROVOD_NCCL_INCLUDE="$dir/include" \
    HOROVOD_NCCL_LIB="$dir/lib" HOROVOD_NCCL_LINK=SHARED
}

horovod_nccl_check() {
  local so=$1
  if ! readelf -d "$so" 2>/dev/null | grep -q 'NEEDED.*\[libnccl\.so\.2\]'; then
    echo "$so does not load libnccl.so.2 dynamically (NCCL linked statically, or no NCCL operations)" >&2
    return 1
  fi
  if readelf --dyn-syms -W "$so" | awk '$7 != "UND" && $8 ~ /^p?ncclAllReduce(@|$)/ { found = 1 } END { exit !found }'; then
    echo "$so defines ncclAllReduce itself: a second NCCL is linked in" >&2
    return 1
  fi
}
