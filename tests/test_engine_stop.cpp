#include <gtest/gtest.h>

#include "engine/stop.hpp"

using namespace kvq;

TEST(EngineStop, HoldsBackPartialMatchesAndCutsAtTheStopString) {
  StopMatcher m({"\n\n", "END"});
  bool stopped = false;
  EXPECT_EQ(m.push("hello E", &stopped), "hello ");  // "E" may start "END"
  EXPECT_FALSE(stopped);
  EXPECT_EQ(m.push("N", &stopped), "");
  EXPECT_EQ(m.push("Xtra\n", &stopped), "ENXtra");
  EXPECT_FALSE(stopped);
  EXPECT_EQ(m.push("\nmore", &stopped), "");
  EXPECT_TRUE(stopped);
}

TEST(EngineStop, StopStringInsideOnePieceAndFlush) {
  StopMatcher m({"</s>"});
  bool stopped = false;
  EXPECT_EQ(m.push("abc</s>def", &stopped), "abc");
  EXPECT_TRUE(stopped);
  StopMatcher n({"xyz"});
  EXPECT_EQ(n.push("abcx", &stopped), "abc");
  EXPECT_FALSE(stopped);
  EXPECT_EQ(n.flush(), "x");
  StopMatcher none({});
  EXPECT_EQ(none.push("anything", &stopped), "anything");
  EXPECT_FALSE(stopped);
}
