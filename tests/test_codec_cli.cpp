// `kvq codecs --json`: every seed codec, the QJL forms and the per-side blocks,
// all within budget at D = 64, 128, 256.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "cli_test_util.hpp"

namespace {

// kvq's stderr (logs, errors), then its stdout (the results).
std::string run(const std::string& args, int* status = nullptr) {
  const kvq::test::CliOut o = kvq::test::kvq_cli(args);
  if (status) *status = o.rc;
  return o.err + o.out;
}

}  // namespace

TEST(CodecCli, JsonListsEverySeedCodecWithinBudget) {
  const std::set<std::string> seeds = {
      "none",      "k8v8",     "k8v4",     "k8vturbo3", "k8vturbo2",  "k8vturbo3tcq", "k8vturbo2tcq",
      "tsym3",     "tsym4",    "planar",   "planar3",   "planar_k",   "iso3",         "iso4",
      "iso3_sym",  "iso4_sym", "k_iso3",   "k_iso4",    "rotor3",     "rotor4",       "rotor3_sym",
      "rotor4_sym", "k_rotor3", "k_rotor4", "rot_k_tq4v"};
  ASSERT_EQ(seeds.size(), 25u);
  for (int d : {64, 128, 256}) {
    int st = -1;
    const auto j = nlohmann::json::parse(run("codecs --json --head-dim " + std::to_string(d) + " --kv-heads 8", &st));
    ASSERT_EQ(st, 0);
    std::set<std::string> named, qjl;
    for (const auto& c : j["codecs"]) {
      EXPECT_TRUE(c["within_budget"].get<bool>()) << c["name"];
      EXPECT_LE(c["k_bits"].get<double>(), c["k_budget_bits"].get<double>() + 1e-9);
      EXPECT_LE(c["v_bits"].get<double>(), c["v_budget_bits"].get<double>() + 1e-9);
      if (c["form"] == "named" && c["seed_codec"].get<bool>()) named.insert(c["name"]);
      if (c["form"] == "rotor_qjl") qjl.insert(c["name"]);
      EXPECT_EQ(c["bytes_per_token_per_layer"].get<double>(),
                8 * d * (c["k_bits"].get<double>() + c["v_bits"].get<double>()) / 8);
    }
    EXPECT_EQ(named, seeds);
    EXPECT_EQ(qjl, (std::set<std::string>{"rotor3_sym+qjl", "rotor4_sym+qjl", "k_rotor3+qjl", "k_rotor4+qjl"}));
    int nblocks = 0;
    for (const auto& b : j["blocks"]) {
      EXPECT_TRUE(b["within_budget"].get<bool>()) << b["name"] << " D=" << d;
      ++nblocks;
    }
    EXPECT_EQ(nblocks, 30);  // 15 blocks, each also +qjl
  }
}

TEST(CodecCli, TextListing) {
  int st = -1;
  const auto out = run("codecs", &st);
  EXPECT_EQ(st, 0);
  EXPECT_NE(out.find("rot_k_tq4v"), std::string::npos);
  EXPECT_NE(out.find("k8vturbo2tcq"), std::string::npos);
}
