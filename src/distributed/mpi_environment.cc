// launched_as_mpi_ranks() reads only the launcher's environment, so it is built with or without
// MPI: a gemstage built without it (the aarch64 cross build, a machine without Open MPI) still
// recognizes `mpirun -np K gemstage ...` and refuses it with a message instead of running K
// copies of the command.
#include <cstdlib>

#include "distributed/mpi_launch.h"

namespace gemstage {

bool launched_as_mpi_ranks() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
    if (const char* v = std::getenv(var)) return std::atoi(v) > 1;
  return false;
}

}  // namespace gemstage
