// fsdp_strategies_bench (default mode): for each world size, launches the worker on that many
// CPU ranks (torchrun, Gloo) and the FSDP2 + torch.optim.Muon peer (bench/peers/fsdp2_muon.py)
// on as many, with the same model and batch; prints both side by side, the ratios against the
// issue's goals, writes memory.tsv and, through bench/plot_memory.py, memory.png; the last line
// is the headline.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "strategies.h"

#ifndef FSDP_MUON_SOURCE_DIR
#error "FSDP_MUON_SOURCE_DIR must name the source tree (bench/CMakeLists.txt sets it)"
#endif

namespace fsdp_muon_bench {

ResultLine parse_result_line(const std::string& line, const std::string& prefix) {
  ResultLine out;
  if (line.rfind(prefix, 0) != 0) return out;
  std::stringstream ss(line.substr(prefix.size()));
  std::string item;
  while (ss >> item) {
    const size_t eq = item.find('=');
    if (eq != std::string::npos) out[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return out;
}

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string self_executable() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  TORCH_CHECK(n > 0, "fsdp_strategies_bench: cannot read /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string tail(const std::string& text, size_t lines) {
  size_t pos = text.size();
  for (size_t i = 0; i <= lines && pos != std::string::npos && pos > 0; ++i) {
    pos = text.rfind('\n', pos - 1);
  }
  return pos == std::string::npos ? text : text.substr(pos + 1);
}

// Runs `command` with its output in `log`; throws with the log's tail when it fails.
std::string run_logged(const std::string& what, const std::string& command,
                       const std::string& log) {
  std::fflush(stdout);
  const int rc = std::system((command + " >" + shell_quote(log) + " 2>&1").c_str());
  const std::string out = read_file(log);
  TORCH_CHECK(rc == 0, "fsdp_strategies_bench: ", what, " failed (status ", rc, "); command:\n  ",
              command, "\nlast lines of ", log, ":\n", tail(out, 25));
  return out;
}

// The 1-minute load average: other work on the machine, printed beside the times it skews.
std::string load_average() {
  std::string text = read_file("/proc/loadavg");
  return text.empty() ? std::string("?") : text.substr(0, text.find(' '));
}

std::vector<ResultLine> lines_with(const std::string& text, const std::string& prefix) {
  std::vector<ResultLine> out;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    if (line.rfind(prefix, 0) == 0) out.push_back(parse_result_line(line, prefix));
  }
  return out;
}

double num(const ResultLine& r, const std::string& key) {
  auto it = r.find(key);
  TORCH_CHECK(it != r.end(), "fsdp_strategies_bench: a result line lacks '", key, "'");
  return std::stod(it->second);
}

struct PerWorld {
  int world = 0;
  std::vector<ResultLine> ours;  // one per (strategy, prefetch)
  ResultLine peer;
  const ResultLine* find(const std::string& strategy, bool prefetch) const {
    for (const auto& r : ours) {
      if (r.at("strategy") == strategy && r.at("prefetch") == (prefetch ? "1" : "0")) return &r;
    }
    return nullptr;
  }
};

}  // namespace

int run_strategies_driver(Flags& flags) {
  const std::vector<int64_t> worlds = flags.get_ints("world-sizes", {1, 2, 4});
  const int64_t layers = flags.get_int("layers", 4);
  const int64_t width = flags.get_int("width", 256);
  const int64_t heads = flags.get_int("heads", 4);
  const int64_t vocab = flags.get_int("vocab", 8192);
  const int64_t seq_len = flags.get_int("seq-len", 128);
  const int64_t batch = flags.get_int("batch", 4);
  const int64_t steps = flags.get_int("steps", 5);
  const int64_t warmup = flags.get_int("warmup", 1);
  const int64_t threads = flags.get_int("threads", 1);
  // HSDP: groups sharded over this many ranks and replicated over W / shard-size (0: every rank,
  // the 1-D run, whose command lines and output are those of a run without the flag).
  const int64_t shard_size = flags.get_int("shard-size", 0);
  const std::string out_dir = flags.get("out-dir", "fsdp_strategies_bench_out");
  const char* env_python = std::getenv("FSDP_MUON_PYTHON");
  const std::string python = flags.get("python", env_python != nullptr ? env_python : "");
  const std::string peer_script =
      flags.get("peer-script", std::string(FSDP_MUON_SOURCE_DIR) + "/bench/peers/fsdp2_muon.py");
  const std::string plot_script =
      flags.get("plot-script", std::string(FSDP_MUON_SOURCE_DIR) + "/bench/plot_memory.py");
  flags.finish();
  TORCH_CHECK(!python.empty(),
              "fsdp_strategies_bench: no python with torch to launch the ranks and the FSDP2 peer "
              "with; `source scripts/env.sh` (sets FSDP_MUON_PYTHON) or pass --python");
  TORCH_CHECK(!worlds.empty(), "fsdp_strategies_bench: --world-sizes is empty");
  TORCH_CHECK(threads >= 1, "fsdp_strategies_bench: --threads must be >= 1");
  for (int64_t w : worlds) {
    TORCH_CHECK(w >= 1 && w <= 64, "fsdp_strategies_bench: --world-sizes: ", w,
                " is not in [1, 64]");
  }
  // A shard size that does not divide a world size is an error before anything is launched,
  // not a skipped W: the user asked for that mesh, and a table without the W they listed would
  // read as a complete run.
  TORCH_CHECK(shard_size >= 0,
              "fsdp_strategies_bench: --shard-size must be >= 1 (or 0: every rank), got ",
              shard_size);
  if (shard_size > 0) {
    std::string bad;
    for (int64_t w : worlds) {
      if (w % shard_size != 0)
        bad += format("%s%lld", bad.empty() ? "" : ",", static_cast<long long>(w));
    }
    TORCH_CHECK(bad.empty(), "fsdp_strategies_bench: --shard-size ", shard_size,
                " does not divide --world-sizes ", bad,
                " (an HSDP mesh is W / shard-size replicas of shard-size ranks); give world "
                "sizes that are multiples of ",
                shard_size, ", or --shard-size 0 for every rank");
  }
  // The mesh of world size w, "<replicas>x<shard size>" as DeviceMesh::shape() prints it.
  auto mesh_of = [&](int64_t w) {
    const int64_t s = shard_size > 0 ? shard_size : w;
    return format("%lldx%lld", static_cast<long long>(w / s), static_cast<long long>(s));
  };
  const std::string mesh_args =
      shard_size > 0 ? format(" --shard-size %lld", static_cast<long long>(shard_size)) : "";
  TORCH_CHECK(std::system(("mkdir -p " + shell_quote(out_dir)).c_str()) == 0,
              "fsdp_strategies_bench: cannot create --out-dir ", out_dir);

  const std::string model_args = format(
      "--layers %lld --width %lld --heads %lld --vocab %lld --seq-len %lld --batch %lld "
      "--steps %lld --warmup %lld",
      static_cast<long long>(layers), static_cast<long long>(width), static_cast<long long>(heads),
      static_cast<long long>(vocab), static_cast<long long>(seq_len), static_cast<long long>(batch),
      static_cast<long long>(steps), static_cast<long long>(warmup));
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::printf(
      "fsdp_strategies_bench: GPT-2 shapes (%lld layers, width %lld, %lld heads, vocab "
      "%lld), %lld x %lld tokens per rank, %lld steps after %lld warm-up, W = ",
      static_cast<long long>(layers), static_cast<long long>(width), static_cast<long long>(heads),
      static_cast<long long>(vocab), static_cast<long long>(batch), static_cast<long long>(seq_len),
      static_cast<long long>(steps), static_cast<long long>(warmup));
  for (size_t i = 0; i < worlds.size(); ++i) {
    std::printf("%s%lld", i ? "," : "", static_cast<long long>(worlds[i]));
  }
  std::printf(
      " on %u CPU cores (Gloo)%s; each W: ours (every strategy, prefetch on/off) in one "
      "launch, then the peer in another; logs in %s\n",
      cores,
      shard_size > 0
          ? format(", HSDP: shard groups of %lld rank(s), replicated over W / %lld",
                   static_cast<long long>(shard_size), static_cast<long long>(shard_size))
                .c_str()
          : "",
      out_dir.c_str());

  std::vector<PerWorld> all;
  for (const int64_t w : worlds) {
    const std::string launch = format(
        "%s -m torch.distributed.run --standalone --nnodes=1 "
        "--nproc_per_node=%lld",
        shell_quote(python).c_str(), static_cast<long long>(w));
    const std::string env = format("OMP_NUM_THREADS=%lld ", static_cast<long long>(threads));
    PerWorld pw;
    pw.world = static_cast<int>(w);
    const std::string load_before = load_average();
    const std::string ours_log =
        format("%s/ours_w%lld.log", out_dir.c_str(), static_cast<long long>(w));
    const std::string ours = run_logged(
        format("the worker at W=%lld", static_cast<long long>(w)),
        env + launch + " --no-python " + shell_quote(self_executable()) + " --worker " +
            model_args + format(" --threads %lld", static_cast<long long>(threads)) + mesh_args,
        ours_log);
    pw.ours = lines_with(ours, "strategy: ");
    TORCH_CHECK(pw.ours.size() == 6, "fsdp_strategies_bench: the worker at W=", w, " printed ",
                pw.ours.size(), " result lines, expected 6 (see ", ours_log, ")");
    const std::string peer_log =
        format("%s/peer_w%lld.log", out_dir.c_str(), static_cast<long long>(w));
    const std::string peer =
        run_logged(format("the FSDP2 peer at W=%lld", static_cast<long long>(w)),
                   env + launch + " " + shell_quote(peer_script) + " " + model_args +
                       format(" --threads %lld", static_cast<long long>(threads)) + mesh_args,
                   peer_log);
    const auto peer_lines = lines_with(peer, "peer: ");
    TORCH_CHECK(peer_lines.size() == 1, "fsdp_strategies_bench: the peer at W=", w,
                " printed no result line (see ", peer_log, ")");
    pw.peer = peer_lines[0];
    if (shard_size > 0) {
      // Both sides ran on the mesh asked for (the worker's DeviceMesh, the peer's DeviceMesh).
      for (const ResultLine* r : {&pw.ours[0], &pw.peer}) {
        const auto it = r->find("mesh");
        TORCH_CHECK(it != r->end() && it->second == mesh_of(w), "fsdp_strategies_bench: at W=", w,
                    " the ", r == &pw.peer ? peer_log : ours_log, " run reports mesh ",
                    it == r->end() ? std::string("(none)") : it->second, ", expected ", mesh_of(w));
      }
    }
    all.push_back(pw);

    // This W's table.
    const ResultLine& any = pw.ours[0];
    const double model_bytes = num(any, "model_bytes");
    const double two_groups = 2.0 * num(any, "largest_group_bytes");
    std::printf(
        "\n== W=%lld%s, %lld intra-op thread(s) per rank, load average %s -> %s: %.2f M "
        "parameters, weights %.2f MiB, weights + grads %.2f MiB, two groups' worth %.2f MiB\n",
        static_cast<long long>(w),
        shard_size > 0 ? format(" (mesh %s, replicas x shard)", mesh_of(w).c_str()).c_str() : "",
        static_cast<long long>(threads), load_before.c_str(), load_average().c_str(),
        num(any, "params") / 1e6, model_bytes / kMiB, 2 * model_bytes / kMiB, two_groups / kMiB);
    std::printf("%-30s %-4s %9s %8s %8s %8s %8s %8s %10s %7s %7s %9s %11s\n", "who", "pf",
                "step ms", "fwd", "bwd", "rs", "adamw", "muon", "peak MiB", "/W+G", "/2grp",
                "state MiB", "final loss");
    for (const auto& r : pw.ours) {
      const std::string strategy = r.at("strategy");
      const char* zero = strategy == "optim"         ? "ZeRO-1"
                         : strategy == "optim_grads" ? "ZeRO-2"
                                                     : "ZeRO-3";
      const double peak = num(r, "peak_unsharded_bytes");
      std::printf("%-30s %-4s %9.1f %8.1f %8.1f %8.1f %8.1f %8.1f %10.2f %7.3f %7.3f %9.2f %11s\n",
                  format("fsdp_muon %s (%s)", strategy.c_str(), zero).c_str(),
                  r.at("prefetch") == "1" ? "on" : "off", num(r, "step_ms"), num(r, "forward_ms"),
                  num(r, "backward_ms"), num(r, "reduce_scatter_ms"), num(r, "adamw_ms"),
                  num(r, "muon_ms"), peak / kMiB, peak / (2 * model_bytes), peak / two_groups,
                  num(r, "sharded_state_bytes") / kMiB, r.at("final_loss").c_str());
    }
    const double peer_peak = num(pw.peer, "peak_unsharded_bytes");
    std::printf("%-30s %-4s %9.1f %8s %8s %8s %8s %8s %10.2f %7.3f %7.3f %9.2f %11s\n",
                "FSDP2 + torch.optim.Muon", "-", num(pw.peer, "step_ms"), "", "", "", "", "",
                peer_peak / kMiB, peer_peak / (2 * model_bytes), peer_peak / two_groups,
                num(pw.peer, "sharded_state_bytes") / kMiB, pw.peer.at("final_loss").c_str());
    std::printf("  (FSDP2's flat staging buffers at its peak, not counted above: %.2f MiB)\n",
                num(pw.peer, "peak_staging_bytes") / kMiB);
    if (shard_size > 0) {
      // Ours by communicator (the worker checked them against the mesh and FsdpMuon's plan);
      // FSDP2 on the same mesh: reduce-scatter in "shard", all-reduce over "replicate".
      std::printf(
          "  bytes per rank per step (MiB, max rank) on mesh %s: gradient reduction in the "
          "shard group / across replicas, weight all-gathers, FsdpMuon gather + scatter within "
          "the replica / to other replicas\n",
          mesh_of(w).c_str());
      std::printf("  %-28s %-4s %10s %10s %10s %11s %11s  %s\n", "who", "pf", "grad shard",
                  "grad repl", "wt gather", "muon intra", "muon inter", "replica NS");
      for (const auto& r : pw.ours) {
        std::printf("  %-28s %-4s %10.3f %10.3f %10.3f %11.3f %11.3f  %s\n",
                    format("fsdp_muon %s", r.at("strategy").c_str()).c_str(),
                    r.at("prefetch") == "1" ? "on" : "off", num(r, "grad_shard_bytes") / kMiB,
                    num(r, "grad_replica_bytes") / kMiB, num(r, "weight_gather_bytes") / kMiB,
                    num(r, "optim_intra_bytes") / kMiB, num(r, "optim_inter_bytes") / kMiB,
                    r.at("replica_ns").c_str());
      }
    }
  }

  // Summary against the goals, and the plot's data.
  std::printf(
      "\n== Goals: ZeRO-3 peak <= two groups' worth; ZeRO-3 step <= 1.15x ZeRO-1; ours "
      "(ZeRO-3, prefetch on) faster than the FSDP2 peer\n");
  std::printf("%4s %10s %10s %10s %10s %9s %9s %9s %9s %10s %10s\n", "W", "Z1 MiB", "Z2 MiB",
              "Z3 MiB", "FSDP2 MiB", "Z3/2grp", "Z3/Z1 on", "Z3/Z1 off", "Z3 on/off", "Z3/peer",
              "Z1/peer");
  const std::string tsv_path = out_dir + "/memory.tsv";
  std::ofstream tsv(tsv_path);
  tsv << "world\tseries\tpeak_unsharded_mib\tsharded_state_mib\ttwo_groups_mib\n";
  double worst_z3_two = 0, worst_z3_z1 = 0, worst_vs_peer = 0;
  std::string vs_peer_list, z3_z1_list;
  for (const auto& pw : all) {
    const auto* z1 = pw.find("optim", true);
    const auto* z2 = pw.find("optim_grads", true);
    const auto* z3 = pw.find("optim_grads_params", true);
    const auto* z1_off = pw.find("optim", false);
    const auto* z3_off = pw.find("optim_grads_params", false);
    TORCH_CHECK(z1 && z2 && z3 && z1_off && z3_off, "fsdp_strategies_bench: missing results");
    const double two_groups = 2.0 * num(*z3, "largest_group_bytes");
    const double z3_two = num(*z3, "peak_unsharded_bytes") / two_groups;
    const double z3_z1 = num(*z3, "step_ms") / num(*z1, "step_ms");
    const double z3_z1_off = num(*z3_off, "step_ms") / num(*z1_off, "step_ms");
    const double vs_peer = num(*z3, "step_ms") / num(pw.peer, "step_ms");
    std::printf("%4d %10.2f %10.2f %10.2f %10.2f %9.3f %9.3f %9.3f %9.3f %10.3f %10.3f\n", pw.world,
                num(*z1, "peak_unsharded_bytes") / kMiB, num(*z2, "peak_unsharded_bytes") / kMiB,
                num(*z3, "peak_unsharded_bytes") / kMiB,
                num(pw.peer, "peak_unsharded_bytes") / kMiB, z3_two, z3_z1, z3_z1_off,
                num(*z3, "step_ms") / num(*z3_off, "step_ms"), vs_peer,
                num(*z1, "step_ms") / num(pw.peer, "step_ms"));
    worst_z3_two = std::max(worst_z3_two, z3_two);
    worst_z3_z1 = std::max(worst_z3_z1, z3_z1);
    worst_vs_peer = std::max(worst_vs_peer, vs_peer);
    vs_peer_list += format("%s%.2f", vs_peer_list.empty() ? "" : "/", vs_peer);
    z3_z1_list += format("%s%.2f", z3_z1_list.empty() ? "" : "/", z3_z1);
    for (const auto& [series, r] :
         std::vector<std::pair<std::string, const ResultLine*>>{{"optim", z1},
                                                                {"optim_grads", z2},
                                                                {"optim_grads_params", z3},
                                                                {"fsdp2_muon", &pw.peer}}) {
      tsv << pw.world << '\t' << series << '\t'
          << format("%.4f", num(*r, "peak_unsharded_bytes") / kMiB) << '\t'
          << format("%.4f", num(*r, "sharded_state_bytes") / kMiB) << '\t'
          << format("%.4f", two_groups / kMiB) << '\n';
    }
  }
  tsv.close();
  const std::string png_path = out_dir + "/memory.png";
  run_logged("the plot",
             shell_quote(python) + " " + shell_quote(plot_script) + " " + shell_quote(tsv_path) +
                 " " + shell_quote(png_path),
             out_dir + "/plot.log");
  std::printf("plot: %s (data %s)\n", png_path.c_str(), tsv_path.c_str());

  std::string worlds_text;
  for (const auto& pw : all)
    worlds_text += format("%s%d", worlds_text.empty() ? "" : ",", pw.world);
  if (shard_size > 0) {
    std::string meshes;
    for (const auto& pw : all)
      meshes += format("%s%s", meshes.empty() ? "" : ",", mesh_of(pw.world).c_str());
    worlds_text += format(" (mesh %s, replicas x shard)", meshes.c_str());
  }
  std::printf(
      "\nheadline: GPT-2 shapes (%lld layers, width %lld) at W=%s on the CPU: ZeRO-3 peak "
      "unsharded <= %.2fx two groups' worth (goal <= 1), ZeRO-3 step / ZeRO-1 %s (goal <= 1.15), "
      "ZeRO-3 step / FSDP2 + torch.optim.Muon %s (goal < 1)%s\n",
      static_cast<long long>(layers), static_cast<long long>(width), worlds_text.c_str(),
      worst_z3_two, z3_z1_list.c_str(), vs_peer_list.c_str(),
      (worst_z3_two <= 1.0 && worst_z3_z1 <= 1.15 && worst_vs_peer < 1.0) ? ": all goals met"
                                                                          : ": goals NOT all met");
  return 0;
}

}  // namespace fsdp_muon_bench
