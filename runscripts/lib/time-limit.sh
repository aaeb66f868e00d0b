# shellcheck shell=bash
# Moved to jobs/lib/time-limit.sh: it runs in the batch script on the host, not in the container.
# This forwarder stays only until jobs/local/mnist.sbatch sources the new path; delete it then.
# shellcheck source=jobs/lib/time-limit.sh
source "${BASH_SOURCE[0]%/*}/../../jobs/lib/time-limit.sh"
