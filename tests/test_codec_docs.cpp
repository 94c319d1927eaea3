// docs/codecs.md's SQNR table is what the code measures: every cell is
// re-measured here with the same function and seed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kv/block.hpp"
#include "kv/quality.hpp"

using namespace kvq::kv;

TEST(CodecDocs, SqnrTableMatches) {
  std::ifstream f(std::string(KVQ_SOURCE_DIR) + "/docs/codecs.md");
  ASSERT_TRUE(f.good());
  std::string line;
  bool in_table = false;
  int rows = 0;
  while (std::getline(f, line)) {
    if (line.rfind("| block | bits/value | Gaussian D=64 |", 0) == 0) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    if (line.rfind("|---", 0) == 0) continue;
    if (line.empty() || line[0] != '|') break;
    std::vector<std::string> cells;
    std::stringstream ss(line.substr(1));
    std::string c;
    while (std::getline(ss, c, '|')) cells.push_back(c.substr(c.find_first_not_of(' '), c.find_last_not_of(' ') - c.find_first_not_of(' ') + 1));
    ASSERT_GE(cells.size(), 6u) << line;
    const BlockSpec b = parse_block(cells[0]);
    EXPECT_NEAR(std::atof(cells[1].c_str()), block_bits_per_value(b, 128), 1e-3) << line;
    const double want[4] = {measure_sqnr_db(b, 64, Fixture::gaussian, kSqnrRows, kSqnrSeed),
                            measure_sqnr_db(b, 128, Fixture::gaussian, kSqnrRows, kSqnrSeed),
                            measure_sqnr_db(b, 256, Fixture::gaussian, kSqnrRows, kSqnrSeed),
                            measure_sqnr_db(b, 128, Fixture::outliers, kSqnrRows, kSqnrSeed)};
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(std::atof(cells[size_t(2 + i)].c_str()), want[i], 0.006) << line;
    ++rows;
  }
  EXPECT_EQ(rows, int(block_names().size()));
}
