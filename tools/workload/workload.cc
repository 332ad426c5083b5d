#include "tools/workload/workload.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "transfer/errors.h"

namespace hicache::workload {
namespace {

// A stream of synthetic token ids for one (seed, stream) pair.
class TokenSource {
 public:
  TokenSource(std::uint64_t seed, std::uint64_t stream)
      : rng_(seed * 0x9E3779B97F4A7C15ULL ^ (stream + 1) * 0xC2B2AE3D27D4EB4FULL) {}
  void append(std::vector<std::int32_t>& out, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) out.push_back(static_cast<std::int32_t>(rng_() >> 33));
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

std::int64_t draw_length(const WorkloadConfig& c, std::mt19937_64& rng) {
  const auto l = static_cast<double>(c.request_tokens);
  double v = l;
  switch (c.length_dist) {
    case LengthDist::kFixed: break;
    case LengthDist::kUniform: v = std::uniform_real_distribution<double>(l / 2, l * 3 / 2)(rng); break;
    case LengthDist::kLognormal: v = std::lognormal_distribution<double>(std::log(l), 0.5)(rng); break;
  }
  return std::max<std::int64_t>(1, std::llround(v));
}

void check_positive(std::int64_t v, const char* name) {
  if (v < 1) throw InvalidArgument(str_cat("workload: ", name, " must be >= 1, got ", v));
}

}  // namespace

Kind parse_kind(std::string_view name) {
  if (name == "multiturn") return Kind::kMultiturn;
  if (name == "longcontext") return Kind::kLongContext;
  if (name == "tree") return Kind::kTree;
  throw InvalidArgument(str_cat("unknown workload '", name, "': valid are multiturn, longcontext, tree"));
}

LengthDist parse_length_dist(std::string_view name) {
  if (name == "fixed") return LengthDist::kFixed;
  if (name == "uniform") return LengthDist::kUniform;
  if (name == "lognormal") return LengthDist::kLognormal;
  throw InvalidArgument(str_cat("unknown length distribution '", name,
                                "': valid are fixed, uniform, lognormal"));
}

std::string_view to_string(Kind kind) {
  switch (kind) {
    case Kind::kMultiturn: return "multiturn";
    case Kind::kLongContext: return "longcontext";
    case Kind::kTree: return "tree";
  }
  return "?";
}

std::string_view to_string(LengthDist dist) {
  switch (dist) {
    case LengthDist::kFixed: return "fixed";
    case LengthDist::kUniform: return "uniform";
    case LengthDist::kLognormal: return "lognormal";
  }
  return "?";
}

void WorkloadConfig::validate() const {
  check_positive(clients, "clients");
  check_positive(rounds, "rounds");
  check_positive(request_tokens, "request_tokens");
  check_positive(documents, "documents");
  check_positive(questions, "questions");
  check_positive(document_tokens, "document_tokens");
  check_positive(trees, "trees");
  check_positive(branching, "branching");
  check_positive(depth, "depth");
  check_positive(tenants, "tenants");
  if (output_tokens < 0 || output_tokens > (1 << 20)) {
    throw InvalidArgument(str_cat("workload: output_tokens must be in [0, 1048576], got ", output_tokens));
  }
  if (system_prompt_tokens < 0) {
    throw InvalidArgument(str_cat("workload: system_prompt_tokens must be >= 0, got ",
                                  system_prompt_tokens));
  }
  // Keep a plan within memory a 2-core CI machine has: 10^8 tokens (400 MB of ids).
  double tokens = 0;
  switch (kind) {
    case Kind::kMultiturn:
      tokens = clients * (static_cast<double>(rounds) * (rounds + 1) / 2) *
               (static_cast<double>(request_tokens) * 1.5 + static_cast<double>(output_tokens) +
                static_cast<double>(system_prompt_tokens));
      break;
    case Kind::kLongContext:
      tokens = static_cast<double>(documents) * questions *
               static_cast<double>(document_tokens + request_tokens + output_tokens);
      break;
    case Kind::kTree:
      tokens = trees * std::pow(branching, depth) * depth *
               static_cast<double>(request_tokens + output_tokens);
      break;
  }
  if (tokens > 1e8) {
    throw InvalidArgument(str_cat("workload: about ", tokens,
                                  " tokens planned, more than 1e8: make it smaller"));
  }
}

std::vector<PlannedRequest> generate(const WorkloadConfig& c) {
  c.validate();
  std::vector<PlannedRequest> out;
  const auto output = static_cast<std::int32_t>(c.output_tokens);
  switch (c.kind) {
    case Kind::kMultiturn: {
      std::vector<std::int32_t> system;
      TokenSource(c.seed, 0).append(system, c.system_prompt_tokens);
      std::vector<std::vector<std::int32_t>> history(static_cast<std::size_t>(c.clients), system);
      std::vector<TokenSource> sources;
      for (int k = 0; k < c.clients; ++k) sources.emplace_back(c.seed, 1 + static_cast<std::uint64_t>(k));
      std::vector<int> last(static_cast<std::size_t>(c.clients), -1);
      for (int r = 0; r < c.rounds; ++r) {
        for (int k = 0; k < c.clients; ++k) {
          auto& h = history[static_cast<std::size_t>(k)];
          auto& src = sources[static_cast<std::size_t>(k)];
          src.append(h, draw_length(c, src.rng()));  // the question
          PlannedRequest p{str_cat("c", k, "-r", r), k, r, h, output,
                           last[static_cast<std::size_t>(k)]};
          src.append(p.tokens, output);               // the answer
          h = p.tokens;                               // the next round continues it
          last[static_cast<std::size_t>(k)] = static_cast<int>(out.size());
          out.push_back(std::move(p));
        }
      }
      break;
    }
    case Kind::kLongContext: {
      std::vector<std::vector<std::int32_t>> docs(static_cast<std::size_t>(c.documents));
      for (int d = 0; d < c.documents; ++d) {
        TokenSource(c.seed, 1000 + static_cast<std::uint64_t>(d)).append(docs[static_cast<std::size_t>(d)], c.document_tokens);
      }
      for (int q = 0; q < c.questions; ++q) {
        for (int d = 0; d < c.documents; ++d) {
          TokenSource src(c.seed, 100000 + static_cast<std::uint64_t>(d) * 1000 + static_cast<std::uint64_t>(q));
          PlannedRequest p{str_cat("d", d, "-q", q), d, q, docs[static_cast<std::size_t>(d)], output, -1};
          src.append(p.tokens, draw_length(c, src.rng()));
          src.append(p.tokens, output);
          out.push_back(std::move(p));
        }
      }
      break;
    }
    case Kind::kTree: {
      for (int t = 0; t < c.trees; ++t) {
        TokenSource src(c.seed, 2000000 + static_cast<std::uint64_t>(t));
        struct Frontier {
          int index;  // request of the node (-1: the root)
          std::vector<std::int32_t> prefix;
        };
        std::vector<Frontier> level{{-1, {}}};
        int node = 0;
        for (int depth = 1; depth <= c.depth; ++depth) {
          std::vector<Frontier> next;
          for (const Frontier& f : level) {
            const int children = 1 + static_cast<int>(src.rng()() % static_cast<std::uint64_t>(c.branching));
            for (int ch = 0; ch < children; ++ch) {
              PlannedRequest p{str_cat("t", t, "-n", node++), t, depth - 1, f.prefix, output, f.index};
              src.append(p.tokens, draw_length(c, src.rng()));
              src.append(p.tokens, output);
              next.push_back({static_cast<int>(out.size()), p.tokens});  // children continue it
              out.push_back(std::move(p));
            }
          }
          level = std::move(next);
        }
      }
      break;
    }
  }
  if (c.tenants > 1) {
    for (PlannedRequest& p : out) {
      const int who = c.kind == Kind::kLongContext ? p.round : p.client;
      p.identity = str_cat("tenant-", who % c.tenants);
    }
  }
  return out;
}

}  // namespace hicache::workload
