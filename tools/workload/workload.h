// Synthetic workloads for hicache-bench and hicache-stress: what clients send, in which order,
// with which dependencies. Tokens are synthetic but deterministic from the seed (the same
// settings give the same requests on every run and in every process of --instances), and the
// engine derives every page's bytes from its token prefix, so any tier can be verified.
//
//   multiturn    C clients, R rounds each (SGLang's bench_multiturn): round r's prompt is the
//                optional shared system prompt, every question and answer of rounds < r, and a
//                new question of L tokens (fixed, uniform in [L/2, 3L/2], or lognormal with
//                median L and sigma 0.5; at least 1); the answer has O tokens. Round r of a
//                client depends on its round r-1.
//   longcontext  D documents of `document_tokens`, Q questions each; a request is a document
//                followed by a question; questions are interleaved across documents (question
//                q of every document before question q+1); round = question index; no
//                dependencies (the first question of a document computes it, later ones hit).
//   tree         T random prefix-sharing trees (agent-like fan-out): every node below the root
//                adds a segment of L tokens to its parent's prefix, and has 1..branching
//                children down to `depth`; a request is the path to one node, depending on its
//                parent's request; round = depth - 1.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace hicache::workload {

enum class Kind { kMultiturn, kLongContext, kTree };
enum class LengthDist { kFixed, kUniform, kLognormal };

// Throw InvalidArgument naming the bad value and the valid ones.
Kind parse_kind(std::string_view name);
LengthDist parse_length_dist(std::string_view name);
std::string_view to_string(Kind kind);
std::string_view to_string(LengthDist dist);

struct WorkloadConfig {
  Kind kind = Kind::kMultiturn;
  std::uint64_t seed = 1;
  // multiturn
  int clients = 8, rounds = 5;
  std::int64_t request_tokens = 512;  // L: question length (also the tree's segment)
  LengthDist length_dist = LengthDist::kUniform;
  std::int64_t output_tokens = 32;    // O
  std::int64_t system_prompt_tokens = 256;
  // longcontext
  int documents = 4, questions = 4;
  std::int64_t document_tokens = 8192;
  // tree
  int trees = 2, branching = 3, depth = 3;
  // Cache identities (tenants): above 1, each request carries "tenant-<n>" (multiturn: its
  // client's, longcontext: its question's, tree: its tree's, modulo `tenants`), so tenants
  // send the same prompt tokens and never share a page.
  int tenants = 1;

  // Throws InvalidArgument naming the first bad value.
  void validate() const;
};

struct PlannedRequest {
  std::string id;                   // "c3-r2" (multiturn), "d1-q0", "t0-n5"
  int client = 0;                   // conversation / document / tree
  int round = 0;
  std::vector<std::int32_t> tokens;  // prompt, then the answer
  std::int32_t output_tokens = 0;
  int depends_on = -1;               // index of the request that must finish first
  std::string identity;              // the cache identity (WorkloadConfig::tenants)
};

// The requests in the order a client population would send them when nothing holds them back
// (dependencies and arrivals are the runner's).
std::vector<PlannedRequest> generate(const WorkloadConfig& config);

}  // namespace hicache::workload
