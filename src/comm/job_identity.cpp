// Job identity (docs/DESIGN.md §5, Launch). Two jobs pointed at one MASTER_PORT would otherwise
// merge: a rank of one joins the other's store and both train on garbage. Rank 0 writes a record
// of its job; every other rank compares it with its own view before claiming its rank, and
// reports a mismatch back, so both sides stop with an error instead of merging or hanging.

#include "comm/job_identity.h"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "comm/launch_environment.h"
#include "comm/rendezvous_store.h"
#include "common/check.h"

namespace fsdp_muon::detail {
namespace {

std::string host_name() {
  char name[256] = {};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? std::string(name) : std::string("?");
}

// What a rank says about itself: the same fields for rank 0's record and for a refusal.
struct JobRecord {
  std::string token;   // random per process: tells this process's writes from anyone else's
  int world_size = 0;  // this rank's view of the world size
  std::string job;     // "<launcher>-<launcher's job id>", or "" when the launcher gives none
  std::string who;     // "<launcher> rank R on host H (pid P)"
  std::string reason;  // in a refusal: why this rank refused the job

  std::string encode() const {
    return token + "\n" + std::to_string(world_size) + "\n" + job + "\n" + who + "\n" + reason;
  }
  static JobRecord decode(const std::vector<uint8_t>& bytes) {
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    JobRecord r;
    std::string size;
    std::getline(in, r.token);
    std::getline(in, size);
    std::getline(in, r.job);
    std::getline(in, r.who);
    std::getline(in, r.reason);
    r.world_size = std::atoi(size.c_str());
    return r;
  }
  std::string describe(const std::string& launcher) const {
    return who + ", " + world_size_variable(launcher) + "=" + std::to_string(world_size) + ", " +
           (job.empty() ? std::string("no launcher job id") : "job '" + job + "'");
  }
};

JobRecord own_record(const LaunchEnvironment& e) {
  std::random_device device;
  std::ostringstream token;
  token << std::hex << device() << device() << device() << device();
  JobRecord r;
  r.token = token.str();
  r.world_size = e.world_size;
  if (const auto id = launcher_job_id(e.launcher)) r.job = e.launcher + "-" + *id;
  r.who = e.launcher + " rank " + std::to_string(e.rank) + " on host " + host_name() + " (pid " +
          std::to_string(::getpid()) + ")";
  return r;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

void agree_on_job(c10d::Store& store, const LaunchEnvironment& e, std::chrono::milliseconds timeout,
                  const std::string& waiting) {
  const JobRecord mine = own_record(e);
  const std::string place = store_place(e);
  const std::string fix =
      "; give every job its own MASTER_PORT (and every rank the same "
      "launcher variables)";
  if (e.rank == 0) {
    const std::string record = mine.encode();
    const auto held = store.compareSet("job", {}, bytes_of(record));
    if (held != bytes_of(record)) {
      const JobRecord other = JobRecord::decode(held);
      store.set("verdict",
                bytes_of("another rank 0 (" + mine.describe(e.launcher) + ") uses this store too"));
      FSDP_MUON_CHECK(false, "the rendezvous store ", place,
                      " already belongs to another job: ", "its rank 0 is ",
                      other.describe(e.launcher), "; this rank is ", mine.describe(e.launcher),
                      fix);
    }
    std::vector<std::string> joined;
    for (int r = 1; r < e.world_size; ++r) joined.push_back("joined/" + std::to_string(r));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (store.check({"refused/1"})) {
        const JobRecord other = JobRecord::decode(store.get("refused/1"));
        const std::string error = "a process reached this job's rendezvous store " + place +
                                  " and refused to join: " + other.describe(e.launcher) +
                                  " (it said: " + other.reason + "); this job's rank 0 is " +
                                  mine.describe(e.launcher);
        store.set("verdict", bytes_of(error));
        FSDP_MUON_CHECK(false, error, fix);
      }
      if (joined.empty() || store.check(joined)) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string missing;
        for (int r = 1; r < e.world_size; ++r) {
          if (!store.check({joined[r - 1]})) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          }
        }
        TORCH_CHECK(false, waiting, "rank(s) ", missing, " did not reach the rendezvous store ",
                    place, " within ", timeout.count() / 1000.0, " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    store.set("verdict", bytes_of("ok"));
    return;
  }

  std::vector<uint8_t> held;
  try {
    held = store.get("job");
  } catch (const c10::Error& ex) {
    TORCH_CHECK(false, waiting, "rank 0 did not describe its job in the rendezvous store ", place,
                " within ", timeout.count() / 1000.0, " s: ", ex.what_without_backtrace());
  }
  const JobRecord zero = JobRecord::decode(held);
  std::string error;
  if (!zero.job.empty() && !mine.job.empty() && zero.job != mine.job) {
    error = "the rendezvous store " + place + " belongs to another job: its rank 0 is " +
            zero.describe(e.launcher) + "; this rank is " + mine.describe(e.launcher);
  } else if (zero.world_size != e.world_size) {
    error = std::string("the ranks disagree on the world size: this rank has ") +
            world_size_variable(e.launcher) + "=" + std::to_string(e.world_size) +
            " but rank 0 has " + world_size_variable(e.launcher) + "=" +
            std::to_string(zero.world_size) + " (this rank is " + mine.describe(e.launcher) +
            "; rank 0 is " + zero.describe(e.launcher) + ")";
  } else {
    const std::string key = "joined/" + std::to_string(e.rank);
    const auto claimed = store.compareSet(key, {}, bytes_of(mine.encode()));
    if (claimed != bytes_of(mine.encode())) {
      error = "rank " + std::to_string(e.rank) + " of this job has already joined the " +
              "rendezvous store " + place + " (as " + JobRecord::decode(claimed).who +
              "): two processes have the same rank, or a rank of another job shares the port";
    }
  }
  if (!error.empty()) {
    // Rank 0 learns of the first refusal and reports it too.
    JobRecord refusal = mine;
    refusal.reason = error;
    const int64_t n = store.add("refusals", 1);
    store.set("refused/" + std::to_string(n), bytes_of(refusal.encode()));
    FSDP_MUON_CHECK(false, error, fix);
  }
  std::vector<uint8_t> verdict;
  try {
    verdict = store.get("verdict");
  } catch (const c10::Error& ex) {
    TORCH_CHECK(false, waiting, "rank 0 did not confirm the job in the rendezvous store ", place,
                " within ", timeout.count() / 1000.0, " s: ", ex.what_without_backtrace());
  }
  const std::string text(verdict.begin(), verdict.end());
  FSDP_MUON_CHECK(text == "ok", "rank 0 refused the job: ", text);
}

}  // namespace fsdp_muon::detail
