// The configuration schema: every key of HiCacheConfig described once (name, type, default,
// allowed values, one line of help, the SGLang server flag it corresponds to). The JSON parser,
// the validation messages, every tool's cache flags and their --help, and the configuration
// reference (docs/configuration.md, checked against config_reference_markdown() by a test) all
// come from this one table, so a default or a range cannot differ between them.
//
// SGLang's names are accepted as aliases in SGLang's units (see config_aliases()): a user moving
// from SGLang copies their flags, with '-' as '_' and without the leading "--".
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace hicache {

enum class ConfigType { kInteger, kNumber, kString, kBool, kObject };

struct ConfigKeyInfo {
  std::string_view key;    // JSON key; "model.layers" is "layers" inside the "model" object
  std::string_view flag;   // the tools' flag, without "--"
  ConfigType type;
  std::string_view default_json;  // JSON text of the default; empty: none (required or unset)
  std::string_view allowed;       // the allowed values or range, as errors and help print it
  std::string_view help;          // one line
  std::string_view sglang;        // the SGLang server flag it corresponds to, or empty
  std::string_view differs;       // why the default differs from SGLang's, or empty
};

struct ConfigAliasInfo {
  std::string_view alias;  // SGLang's name, e.g. "hicache_ratio"
  std::string_view maps_to;  // what it sets, in words (units converted)
};

// Every key, in the order of the reference.
std::span<const ConfigKeyInfo> config_keys();
// The SGLang aliases.
std::span<const ConfigAliasInfo> config_aliases();

// The key a tool flag (without "--") names, or null.
const ConfigKeyInfo* find_config_flag(std::string_view flag);

// The JSON text of a flag's value given as text ("16", "lru", "true", a JSON object for
// kObject); throws InvalidArgument naming the flag and the text when it is not of the key's
// type. The range is checked when the config is built.
std::string config_flag_json(const ConfigKeyInfo& key, std::string_view text);

// "  --flag V   help (default D)" lines for a tool's usage.
std::string config_flags_usage();

// The configuration reference in Markdown: one table of every key, then the aliases.
std::string config_reference_markdown();

// The known key (or alias) nearest to `unknown` by edit distance, or empty when none is close.
std::string nearest_config_key(std::string_view unknown);

}  // namespace hicache
