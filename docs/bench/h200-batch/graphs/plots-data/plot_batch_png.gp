set terminal png size 1100,650 background '#ffffff'
set grid
set key outside right top noenhanced
set logscale x 2
set yrange [0:*]
set offsets graph 0.04, graph 0.04, graph 0.05, 0
set xlabel 'sequences per decode step'
set ylabel 'aggregate decode tok/s'
set title 'Aggregate decode tok/s vs batch (median; bars: min..max)'
set output 'tps_vs_batch.png'
plot 'plots-data/batch0.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 1 title 'none', \
     'plots-data/batch1.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 2 title 'tsym3', \
     'plots-data/batch2.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 3 title 'k8vturbo2'
