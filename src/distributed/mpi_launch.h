// Running one command's stages across the ranks of an MPI job (issue 22):
//
//   mpirun -np 3 gemstage generate -m BUNDLE -p "..." [--placement "0=... 1=... 2=..."]
//
// Every rank runs the same command line. Rank 0 reads the bundle's manifest, places the stages
// (distributed/placement.h) and sends the placement to every rank; each worker rank opens only
// its own stages (mapping only their weight files) and reports who it is; rank 0 checks that all
// opened the same bundle and hold what they must (else every rank stops, the message naming the
// rank and host), then runs the command with the other ranks' stages as RemoteStageClients over
// MPI, while each worker serves its stages (StageWorker) until rank 0 says it is done.
//
// A worker sends a heartbeat while a call computes, so rank 0 tells a long prefill from a dead or
// hung rank: a rank silent for --stage-timeout seconds fails the call that waits on it, naming
// the stage, rank and host, and fails every later call at once (serve's /health then answers 503
// with the message). Built only with MPI (GEMSTAGE_HAVE_MPI), except launched_as_mpi_ranks(),
// which every build has (distributed/mpi_environment.cc) so one without MPI can refuse mpirun.
#pragma once

#include <memory>
#include <string>

#include "stage/model.h"

namespace gemstage {

// Whether this process was started by an MPI launcher as one of several ranks (read from the
// launcher's environment, before MPI is initialized).
bool launched_as_mpi_ranks();

struct DistributedOptions {
  std::string bundle;     // this rank's -m
  std::string placement;  // --placement text; empty: default_placement
  int threads = 0;        // a worker's compute threads (0: default_thread_count)
  double stage_timeout_seconds = 30;
};

class DistributedSession {
 public:
  // Initializes MPI and runs the start-up handshake on every rank; throws (on every rank, each
  // with the reason) if it fails. On rank 0, models() then opens the bundle with the other ranks'
  // stages as remote clients.
  static std::unique_ptr<DistributedSession> start(const DistributedOptions& o);
  // Rank 0: tells every worker to leave its loop, then finalizes MPI. After a rank failed, the
  // job is aborted instead (a dead rank cannot take part in an orderly finalize).
  ~DistributedSession();

  int rank() const;
  int ranks() const;
  bool is_worker() const { return rank() != 0; }
  // Rank 0: what the command opens its models with (stage/model.h ModelOpener).
  const ModelOpener& models() const;
  // A worker's loop: serves its stages until rank 0 ends the job. Returns the exit code.
  int run_worker();

  struct Impl;

 private:
  explicit DistributedSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gemstage
