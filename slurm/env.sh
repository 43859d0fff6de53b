# shellcheck shell=bash
# relay job environment: the ONE place a job's environment is set.
#
#   source slurm/env.sh        # from every sbatch script and every launcher (submitit) job
#
# Sourced, never executed. Safe under the caller's `set -euo pipefail` and `set -x`
# (xtrace is paused while it runs, so secrets are never traced). It never calls `exit`;
# it returns 1 only for a configuration error (an unknown RELAY_NETWORK), after logging it.
# Every value it sets, or keeps because it was already set, is logged to stderr as one
# line `[relay env] NAME=value (default|preset|derived)`; secrets only as set/not set.
# Every default below can be overridden by exporting the variable before sourcing
# (an empty value counts as unset).
#
# Kernel caches
#   RELAY_NODE_CACHE_ROOT    node-local cache root       default /tmp/relay-$USER
#   TRITON_CACHE_DIR         Triton kernels (node-local) default $RELAY_NODE_CACHE_ROOT/triton
#   TORCHINDUCTOR_CACHE_DIR  Inductor (node-local)       default $RELAY_NODE_CACHE_ROOT/inductor
#   RELAY_CACHE_ROOT         shared, persistent root     default $HOME/.cache/relay
#                            (point it at shared storage: FA4/quack tuning takes minutes a shape)
#   FLASH_ATTENTION_CUTE_DSL_CACHE_DIR                   default $RELAY_CACHE_ROOT/fa4_cute_dsl
#   FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED               default 1 (older FA4 releases keep
#                                                        the disk cache off otherwise)
#   QUACK_CACHE_DIR                                      default $RELAY_CACHE_ROOT/quack
#   All cache directories are created.
# Offline hub (compute nodes have no internet)
#   HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, HF_DATASETS_OFFLINE=1
# Threads
#   OMP_NUM_THREADS          default $SLURM_CPUS_PER_TASK, else 1
# Network (RELAY_NETWORK = efa | ib | tcp | none, default tcp; case-insensitive)
#   efa:  FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 FI_EFA_FORK_SAFE=1
#         FI_EFA_SET_CUDA_SYNC_MEMOPS=0; LD_LIBRARY_PATH prepended with
#         RELAY_OFI_NCCL_DIR (the aws-ofi-nccl plugin, libnccl-net*.so; default: the first of
#         /opt/amazon/ofi-nccl/lib/x86_64-linux-gnu, /opt/amazon/ofi-nccl/lib64,
#         /opt/amazon/ofi-nccl/lib, /opt/amazon/aws-ofi-nccl/lib, /opt/aws-ofi-nccl/lib that
#         exists; a warning when none does) and RELAY_EFA_LIB_DIR (libfabric, default
#         /opt/amazon/efa/lib or lib64, when it exists); NCCL_SOCKET_IFNAME.
#         Per-GPU NIC pinning: NCCL picks the NIC closest to each GPU from the PCI topology;
#         where the VM hides it, give NCCL (and through it aws-ofi-nccl) a topology file:
#         RELAY_NCCL_TOPO_FILE -> NCCL_TOPO_FILE (only when set; warned when missing).
#   ib:   NCCL_IB_HCA from RELAY_NCCL_IB_HCA (e.g. "=mlx5_0,mlx5_1"; unset: NCCL's own
#         choice), NCCL_SOCKET_IFNAME; NCCL_TOPO_FILE as for efa.
#   tcp:  NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME.
#   none: nothing.
#   NCCL_SOCKET_IFNAME       default $RELAY_NCCL_SOCKET_IFNAME, else "^lo,docker"
# PyTorch NCCL error handling and flight recorder
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (always)
#   with RELAY_OUTPUT_DIR set (the run's output_dir): TORCH_NCCL_TRACE_BUFFER_SIZE=2000,
#   TORCH_NCCL_DUMP_ON_TIMEOUT=1, TORCH_NCCL_DEBUG_INFO_TEMP_FILE=
#   $RELAY_OUTPUT_DIR/nccl-flight-recorder/job<id>-r<restart>-rank_  (torch appends the rank;
#   the directory is created). Read dumps with torch's fr_trace tool.
# Rendezvous
#   MASTER_ADDR  in a Slurm job: first host of SLURM_JOB_NODELIST (scontrol show hostnames;
#                without scontrol the list's first entry is expanded here; last resort:
#                this host). Outside Slurm: left unset.
#   MASTER_PORT  in a Slurm job: 20000 + SLURM_JOB_ID % 20000; outside Slurm: 29500.
# Secrets (never printed): WANDB_API_KEY, HF_TOKEN -> "set (hidden)" / "not set".
# Other switches
#   RELAY_ENV_QUIET=1        do not log (errors and warnings are still printed)
# Sets RELAY_ENV_SOURCED=1.

# Pause xtrace so that no secret is ever traced; restored at the end.
case $- in *x*) _relay_xtrace=1; set +x ;; *) _relay_xtrace=0 ;; esac

_relay_rc=0

_relay_log() {
    [[ "${RELAY_ENV_QUIET:-0}" == 1 ]] || printf '[relay env] %s\n' "$*" >&2
}
_relay_warn() { printf '[relay env] WARNING: %s\n' "$*" >&2; }
_relay_error() { printf '[relay env] ERROR: %s\n' "$*" >&2; }

# _relay_set NAME DEFAULT [WHY]: keep a preset non-empty NAME, else set DEFAULT; export; log.
_relay_set() {
    local _relay_n="$1" _relay_v="$2" _relay_why="${3:-default}"
    if [[ -n "${!_relay_n:-}" ]]; then
        export "${_relay_n?}"
        _relay_log "${_relay_n}=${!_relay_n} (preset)"
    else
        export "${_relay_n}=${_relay_v}"
        _relay_log "${_relay_n}=${_relay_v} (${_relay_why})"
    fi
}

# _relay_mkdir VAR...: create the directories the variables name; warn, never fail.
_relay_mkdir() {
    local _relay_n
    for _relay_n in "$@"; do
        mkdir -p -- "${!_relay_n}" 2>/dev/null || _relay_warn "cannot create ${_relay_n}=${!_relay_n}"
    done
}

# _relay_first_host NODELIST: first host of a Slurm hostlist expression, without scontrol.
# "node[01-04,07],gpu5" -> node01; "a-1,b-2" -> a-1; "rack[1-2]-n[3-4]" -> rack1-n3.
_relay_first_host() {
    local _relay_s="$1" _relay_out="" _relay_in
    while [[ -n "$_relay_s" ]]; do
        case "${_relay_s:0:1}" in
        ,) break ;;
        '[')
            _relay_in="${_relay_s#\[}"
            _relay_in="${_relay_in%%]*}"
            _relay_in="${_relay_in%%,*}"
            _relay_out+="${_relay_in%%-*}"
            [[ "$_relay_s" == *']'* ]] || break
            _relay_s="${_relay_s#*]}"
            ;;
        *)
            _relay_out+="${_relay_s:0:1}"
            _relay_s="${_relay_s:1}"
            ;;
        esac
    done
    printf '%s' "$_relay_out"
}

_relay_user="${USER:-${LOGNAME:-}}"
if [[ -z "$_relay_user" ]]; then
    _relay_user="$(id -un 2>/dev/null)" || _relay_user="uid$(id -u 2>/dev/null || echo unknown)"
fi

# ---- kernel caches
_relay_set RELAY_NODE_CACHE_ROOT "/tmp/relay-${_relay_user}"
_relay_set TRITON_CACHE_DIR "${RELAY_NODE_CACHE_ROOT}/triton"
_relay_set TORCHINDUCTOR_CACHE_DIR "${RELAY_NODE_CACHE_ROOT}/inductor"
_relay_set RELAY_CACHE_ROOT "${HOME:-${RELAY_NODE_CACHE_ROOT}}/.cache/relay"
_relay_set FLASH_ATTENTION_CUTE_DSL_CACHE_DIR "${RELAY_CACHE_ROOT}/fa4_cute_dsl"
_relay_set FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED 1
_relay_set QUACK_CACHE_DIR "${RELAY_CACHE_ROOT}/quack"
_relay_mkdir TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR FLASH_ATTENTION_CUTE_DSL_CACHE_DIR QUACK_CACHE_DIR

# ---- offline hub, threads
_relay_set HF_HUB_OFFLINE 1
_relay_set TRANSFORMERS_OFFLINE 1
_relay_set HF_DATASETS_OFFLINE 1
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    _relay_set OMP_NUM_THREADS "${SLURM_CPUS_PER_TASK}" "from SLURM_CPUS_PER_TASK"
else
    _relay_set OMP_NUM_THREADS 1
fi

# ---- network
[[ -z "${RELAY_NETWORK:-}" ]] || RELAY_NETWORK="${RELAY_NETWORK,,}"
_relay_set RELAY_NETWORK tcp

_relay_topo() {
    if [[ -n "${RELAY_NCCL_TOPO_FILE:-}" ]]; then
        _relay_set NCCL_TOPO_FILE "${RELAY_NCCL_TOPO_FILE}" "from RELAY_NCCL_TOPO_FILE"
        [[ -r "${NCCL_TOPO_FILE}" ]] || _relay_warn "NCCL_TOPO_FILE=${NCCL_TOPO_FILE} is not a readable file"
    elif [[ -n "${NCCL_TOPO_FILE:-}" ]]; then
        _relay_set NCCL_TOPO_FILE ""
    fi
}

case "$RELAY_NETWORK" in
efa)
    _relay_set FI_PROVIDER efa
    _relay_set FI_EFA_USE_DEVICE_RDMA 1
    _relay_set FI_EFA_FORK_SAFE 1
    _relay_set FI_EFA_SET_CUDA_SYNC_MEMOPS 0
    if [[ -z "${RELAY_OFI_NCCL_DIR:-}" ]]; then
        _relay_ofi=""
        for _relay_d in /opt/amazon/ofi-nccl/lib/x86_64-linux-gnu /opt/amazon/ofi-nccl/lib64 \
            /opt/amazon/ofi-nccl/lib /opt/amazon/aws-ofi-nccl/lib /opt/aws-ofi-nccl/lib; do
            if [[ -d "$_relay_d" ]]; then _relay_ofi="$_relay_d"; break; fi
        done
        _relay_set RELAY_OFI_NCCL_DIR "${_relay_ofi:-/opt/amazon/ofi-nccl/lib}"
        unset _relay_ofi _relay_d
    else
        _relay_set RELAY_OFI_NCCL_DIR ""
    fi
    if [[ ! -d "${RELAY_OFI_NCCL_DIR}" ]]; then
        _relay_warn "aws-ofi-nccl plugin dir RELAY_OFI_NCCL_DIR=${RELAY_OFI_NCCL_DIR} does not exist: NCCL will fall back to sockets"
    fi
    if [[ -z "${RELAY_EFA_LIB_DIR:-}" ]]; then
        for _relay_d in /opt/amazon/efa/lib /opt/amazon/efa/lib64; do
            if [[ -d "$_relay_d" ]]; then export RELAY_EFA_LIB_DIR="$_relay_d"; break; fi
        done
        unset _relay_d
    fi
    _relay_ldp=""
    for _relay_d in "${RELAY_OFI_NCCL_DIR}" "${RELAY_EFA_LIB_DIR:-}"; do
        [[ -n "$_relay_d" && -d "$_relay_d" ]] || continue
        case ":${LD_LIBRARY_PATH:-}:" in *":$_relay_d:"*) ;; *) _relay_ldp+="${_relay_d}:" ;; esac
    done
    if [[ -n "$_relay_ldp" ]]; then
        export LD_LIBRARY_PATH="${_relay_ldp%:}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
    fi
    _relay_log "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} ($([[ -n "$_relay_ldp" ]] && echo "prepended ${_relay_ldp%:}" || echo unchanged))"
    unset _relay_ldp _relay_d
    _relay_set NCCL_SOCKET_IFNAME "${RELAY_NCCL_SOCKET_IFNAME:-^lo,docker}"
    _relay_topo
    ;;
ib)
    if [[ -n "${RELAY_NCCL_IB_HCA:-}" ]]; then
        _relay_set NCCL_IB_HCA "${RELAY_NCCL_IB_HCA}" "from RELAY_NCCL_IB_HCA"
    elif [[ -n "${NCCL_IB_HCA:-}" ]]; then
        _relay_set NCCL_IB_HCA ""
    else
        _relay_log "NCCL_IB_HCA: not set (NCCL picks the HCAs; set RELAY_NCCL_IB_HCA to pin them)"
    fi
    _relay_set NCCL_SOCKET_IFNAME "${RELAY_NCCL_SOCKET_IFNAME:-^lo,docker}"
    _relay_topo
    ;;
tcp)
    _relay_set NCCL_IB_DISABLE 1
    _relay_set NCCL_SOCKET_IFNAME "${RELAY_NCCL_SOCKET_IFNAME:-^lo,docker}"
    ;;
none) ;;
*)
    _relay_error "unknown RELAY_NETWORK='${RELAY_NETWORK}' (expected efa, ib, tcp or none); no network settings applied"
    _relay_rc=1
    ;;
esac

# ---- PyTorch NCCL error handling and flight recorder
_relay_set TORCH_NCCL_ASYNC_ERROR_HANDLING 1
if [[ -n "${RELAY_OUTPUT_DIR:-}" ]]; then
    _relay_set TORCH_NCCL_TRACE_BUFFER_SIZE 2000
    _relay_set TORCH_NCCL_DUMP_ON_TIMEOUT 1
    _relay_set TORCH_NCCL_DEBUG_INFO_TEMP_FILE \
        "${RELAY_OUTPUT_DIR}/nccl-flight-recorder/job${SLURM_JOB_ID:-local}-r${SLURM_RESTART_COUNT:-0}-rank_"
    _relay_fr_dir=""
    [[ "${TORCH_NCCL_DEBUG_INFO_TEMP_FILE}" != */* ]] || _relay_fr_dir="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE%/*}"
    if [[ -n "$_relay_fr_dir" ]]; then
        mkdir -p -- "$_relay_fr_dir" 2>/dev/null || _relay_warn "cannot create flight recorder dir $_relay_fr_dir"
    fi
    unset _relay_fr_dir
else
    _relay_log "NCCL flight recorder: off (RELAY_OUTPUT_DIR not set)"
fi

# ---- rendezvous
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    if [[ -n "${MASTER_ADDR:-}" ]]; then
        _relay_set MASTER_ADDR ""
    else
        _relay_nl="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
        _relay_host=""
        _relay_how=""
        if [[ -n "$_relay_nl" ]] && command -v scontrol >/dev/null 2>&1; then
            _relay_host="$(scontrol show hostnames "$_relay_nl" 2>/dev/null)" || _relay_host=""
            _relay_host="${_relay_host%%$'\n'*}"
            _relay_how="first host of SLURM_JOB_NODELIST via scontrol"
        fi
        if [[ -z "$_relay_host" && -n "$_relay_nl" ]]; then
            _relay_host="$(_relay_first_host "$_relay_nl")"
            _relay_how="first host of SLURM_JOB_NODELIST (parsed, no scontrol)"
        fi
        if [[ -z "$_relay_host" ]]; then
            _relay_host="${HOSTNAME:-}"
            [[ -n "$_relay_host" ]] || _relay_host="$(hostname 2>/dev/null)" || _relay_host="localhost"
            _relay_how="this host: no usable SLURM_JOB_NODELIST"
        fi
        _relay_set MASTER_ADDR "$_relay_host" "$_relay_how"
        unset _relay_nl _relay_host _relay_how
    fi
    if [[ "${SLURM_JOB_ID}" =~ ^[0-9]+$ ]]; then
        _relay_set MASTER_PORT "$((20000 + 10#${SLURM_JOB_ID} % 20000))" "20000 + SLURM_JOB_ID % 20000"
    else
        _relay_warn "SLURM_JOB_ID='${SLURM_JOB_ID}' is not a number; MASTER_PORT defaults to 29500"
        _relay_set MASTER_PORT 29500
    fi
else
    if [[ -n "${MASTER_ADDR:-}" ]]; then
        _relay_set MASTER_ADDR ""
    else
        _relay_log "MASTER_ADDR: not set (not in a Slurm job)"
    fi
    _relay_set MASTER_PORT 29500
fi

# ---- secrets: presence only
for _relay_secret in WANDB_API_KEY HF_TOKEN; do
    if [[ -n "${!_relay_secret:-}" ]]; then
        _relay_log "${_relay_secret}: set (hidden)"
    else
        _relay_log "${_relay_secret}: not set"
    fi
done
unset _relay_secret

export RELAY_ENV_SOURCED=1
unset _relay_user
unset -f _relay_log _relay_warn _relay_error _relay_set _relay_mkdir _relay_first_host _relay_topo
if [[ "$_relay_xtrace" == 1 ]]; then
    unset _relay_xtrace
    set -x
else
    unset _relay_xtrace
fi
# Return the status without leaving _relay_rc behind (eval expands it before the unset).
eval "unset _relay_rc; return ${_relay_rc}"
