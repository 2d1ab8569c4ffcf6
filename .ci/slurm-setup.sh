#!/usr/bin/env bash
# A real one-host Slurm for the tests of the Slurm executor (tests/orchestrator/test_slurm_*.py and the
# executor contract suite's slurm parameter): munged, slurmctld and slurmd from Debian packages, run as root
# daemons on this machine, with slurmdbd on MariaDB (accounts and associations enforced).
#
#   .ci/slurm-setup.sh          install what is missing, write the configs, start what is not running,
#                               wait until the node is idle; prints one line of what it did, e.g.
#                               `slurm-setup: ready on vm in 3s (installed munge ..., started slurmd)`
#
# Idempotent: a cluster that already answers with the node idle (or busy) is left as it is. The node is this
# machine's hostname with 4 CPUs (more than the host may have: SlurmdParameters=config_overrides), so the
# tests' parallel one-CPU jobs fit. Two partitions: `debug` (the default, any account) and `lab` (only
# accounts `lab` and `ml`, a partition-level refusal). Multi-node jobs get emulated nodes on this same machine:
# node1, node2 and node3, each its own `slurmd -N nodeK` (ports 17001-17003; spool dir, pid file and log per
# node through %n, which this Slurm build expands: MULTIPLE_SLURMD) with 4 CPUs, in partition `multi` only, so
# the one-host partitions above are unchanged. A test may kill one of them (a lost node); the next run of this
# script starts it again and returns it to service. slurmdbd (MariaDB database slurm_acct_db)
# knows the cluster and accounts general (root's default), lab and ml; others are refused at submit.
# Scheduling is tuned to start jobs within a second (SchedulerParameters: the backfill pass every second, where
# Slurm's 30 s would keep a job waiting on a node still completing a killed job; a short MessageTimeout), jobs may
# be requeued (JobRequeue=1, PreemptMode=REQUEUE), and finished jobs stay visible to `scontrol show job` for 10
# minutes.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi; }
did=()
started=$(date +%s)

# -- packages -----------------------------------------------------------------------------------------------
pkgs=()
command -v munged >/dev/null || pkgs+=(munge)
command -v slurmctld >/dev/null || pkgs+=(slurmctld)
command -v slurmd >/dev/null || pkgs+=(slurmd)
command -v sbatch >/dev/null || pkgs+=(slurm-client)
command -v slurmdbd >/dev/null || pkgs+=(slurmdbd)
command -v mariadbd >/dev/null || pkgs+=(mariadb-server)
if [ ${#pkgs[@]} -gt 0 ]; then
  { as_root apt-get update -q && as_root apt-get install -y -q --no-install-recommends "${pkgs[@]}"; } \
    >/dev/null 2>&1 || { echo "slurm-setup: could not install ${pkgs[*]} with apt-get" >&2; exit 1; }
  did+=("installed ${pkgs[*]}")
fi

node=$(hostname -s)
conf=/etc/slurm/slurm.conf
emulated_ids="1 2 3"  # the emulated nodes node1..node3 of partition multi

# -- munge -------------------------------------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
  as_root sh -c 'dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null'
  did+=("made a munge key")
fi
as_root chown munge:munge /etc/munge/munge.key
as_root chmod 400 /etc/munge/munge.key
as_root mkdir -p /run/munge /var/log/munge /var/lib/munge
as_root chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  as_root runuser -u munge -- /usr/sbin/munged --force
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  did+=("started munged")
fi

# -- accounting: slurmdbd on MariaDB (accounts and associations enforced, as on a real cluster) -------------
# Started through mysqld_safe and waited on with a ping, not through /etc/init.d/mariadb: that script's own
# check needs /etc/mysql/debian.cnf, which a container's install may lack, and then reports a running server
# as failed.
db_alive() { as_root mariadb-admin ping >/dev/null 2>&1; }
# A daemon started here keeps none of this script's descriptors past stdio (a CI runner's pipes among them).
no_fds=(python3 -c 'import os, sys; os.closerange(3, 65536); os.execvp(sys.argv[1], sys.argv[1:])')
if ! db_alive; then
  as_root mkdir -p /run/mysqld && as_root chown mysql:mysql /run/mysqld
  pgrep -x mariadbd >/dev/null || as_root setsid -f "${no_fds[@]}" /usr/bin/mysqld_safe </dev/null >/dev/null 2>&1
  for _ in $(seq 300); do db_alive && break; sleep 0.2; done
  db_alive || { echo "slurm-setup: MariaDB did not start (for slurmdbd); see /var/log/mysql/error.log" >&2; exit 1; }
  did+=("started mariadb")
fi
as_root mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
  CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm-test';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" \
  || { echo "slurm-setup: could not make slurmdbd's database in MariaDB" >&2; exit 1; }
dbd=$(cat <<EOF
# Written by .ci/slurm-setup.sh: the test cluster's accounting daemon.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm-test
StorageLoc=slurm_acct_db
EOF
)
as_root mkdir -p /etc/slurm /var/log/slurm
if [ "$(as_root cat /etc/slurm/slurmdbd.conf 2>/dev/null)" != "$dbd" ]; then
  printf '%s\n' "$dbd" | as_root tee /etc/slurm/slurmdbd.conf >/dev/null
  as_root chmod 600 /etc/slurm/slurmdbd.conf
  if pgrep -x slurmdbd >/dev/null; then as_root kill "$(pgrep -x slurmdbd)"; sleep 1; fi
  did+=("wrote slurmdbd.conf")
fi
if ! pgrep -x slurmdbd >/dev/null; then
  as_root "${no_fds[@]}" /usr/sbin/slurmdbd </dev/null || { echo "slurm-setup: slurmdbd did not start; see /var/log/slurm/slurmdbd.log" >&2; exit 1; }
  did+=("started slurmdbd")
fi
# -- slurm.conf ---------------------------------------------------------------------------------------------
want=$(cat <<EOF
# Written by .ci/slurm-setup.sh: a one-host test cluster.
ClusterName=autoresearch
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_min_interval=100000,batch_sched_delay=0,default_queue_depth=200,defer_batch=0,bf_interval=1
MessageTimeout=5
KillWait=5
MinJobAge=600
ReturnToService=2
JobRequeue=1
EnforcePartLimits=ALL
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageEnforce=associations,limits,qos
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
NodeName=$node CPUs=4 RealMemory=1024 State=UNKNOWN
$(for k in $emulated_ids; do
  echo "NodeName=node$k NodeHostname=$node NodeAddr=127.0.0.1 Port=$((17000 + k)) CPUs=4 RealMemory=1024 State=UNKNOWN"
done)
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PreemptMode=REQUEUE
PartitionName=lab Nodes=$node Default=NO MaxTime=INFINITE State=UP AllowAccounts=lab,ml PreemptMode=REQUEUE
PartitionName=multi Nodes=node[1-3] Default=NO MaxTime=INFINITE State=UP OverSubscribe=NO PreemptMode=REQUEUE
EOF
)
as_root mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm /var/spool/slurmd/$node
for k in $emulated_ids; do as_root mkdir -p "/var/spool/slurmd/node$k"; done
if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
  printf '%s\n' "$want" | as_root tee "$conf" >/dev/null
  did+=("wrote $conf")
  changed=1
else
  changed=0
fi

# -- accounts (sacctmgr reads slurm.conf to find slurmdbd) --------------------------------------------------
for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done
# The cluster, the accounts the tests use (general: the default; lab and ml: partition lab's), root in all.
if [ -z "$(sacctmgr -n -P list cluster autoresearch format=cluster 2>/dev/null)" ]; then
  as_root sacctmgr -i add cluster autoresearch >/dev/null
  did+=("added the cluster to slurmdbd")
fi
if [ -z "$(sacctmgr -n -P list assoc user=root account=ml format=account 2>/dev/null)" ]; then
  as_root sacctmgr -i add account general,lab,ml cluster=autoresearch >/dev/null 2>&1 || true
  as_root sacctmgr -i add user root account=general,lab,ml defaultaccount=general cluster=autoresearch \
    >/dev/null 2>&1 || true
  did+=("added accounts general, lab, ml for root")
fi

# -- daemons ------------------------------------------------------------------------------------------------
running() { pgrep -x "$1" >/dev/null; }
# One slurmd per node name (this host's and each emulated node's), told apart by its pid file.
slurmd_up() { local pid; pid=$(cat "/run/slurmd-$1.pid" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null \
  && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ]; }
if [ "$changed" = 1 ] && { running slurmctld || running slurmd; }; then
  # Restarted, not reconfigured: some keys (GresTypes) are read only at start. Running jobs keep running
  # under their slurmstepd and are found again from the saved state.
  as_root scontrol shutdown >/dev/null 2>&1 || true
  for _ in $(seq 100); do running slurmctld || running slurmd || break; sleep 0.1; done
  did+=("restarted slurm for the new config")
fi
if ! running slurmctld; then
  as_root /usr/sbin/slurmctld \
    || { echo "slurm-setup: slurmctld did not start; see /var/log/slurm/slurmctld.log" >&2; exit 1; }
  did+=("started slurmctld")
fi
if ! slurmd_up "$node"; then
  as_root /usr/sbin/slurmd || { echo "slurm-setup: slurmd did not start (run slurmd -D -vv to see why)" >&2; exit 1; }
  did+=("started slurmd")
fi
for k in $emulated_ids; do
  if ! slurmd_up "node$k"; then
    as_root /usr/sbin/slurmd -N "node$k" \
      || { echo "slurm-setup: slurmd -N node$k did not start (run slurmd -D -vv -N node$k to see why)" >&2; exit 1; }
    did+=("started slurmd -N node$k")
  fi
done

# -- wait for the node --------------------------------------------------------------------------------------
state=""
for _ in $(seq 120); do
  state=$(sinfo -h -n "$node" -p debug -o %T 2>/dev/null | head -1 || true)
  case "$state" in idle|mixed|allocated) break ;; esac
  case "$state" in down*|drain*|drng*)  # left down by an earlier run (a test's drain, a reboot): back to service
    as_root scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 0.5
done
case "$state" in
  idle|mixed|allocated) ;;
  *) echo "slurm-setup: node $node is not up (sinfo says '${state:-nothing}'); see /var/log/slurm/" >&2; exit 1 ;;
esac
# The emulated nodes: each up in partition multi (one a test left down or drained goes back to service).
for k in $emulated_ids; do
  state=""
  for _ in $(seq 120); do
    state=$(sinfo -h -n "node$k" -p multi -o %T 2>/dev/null | head -1 || true)
    case "$state" in idle|mixed|allocated|completing) break ;; esac
    case "$state" in down*|drain*|drng*|*'*')
      as_root scontrol update nodename="node$k" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  case "$state" in
    idle|mixed|allocated|completing) ;;
    *) echo "slurm-setup: node$k is not up (sinfo says '${state:-nothing}'); see /var/log/slurm/slurmd-node$k.log" >&2
       exit 1 ;;
  esac
done
join() { local IFS='|' all; all="$*"; echo "${all//|/, }"; }
what="ready on $node in $(( $(date +%s) - started ))s"
[ ${#did[@]} -gt 0 ] && what="$what ($(join "${did[@]}"))"
echo "slurm-setup: $what"
