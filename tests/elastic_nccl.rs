//! NCCL groups that follow an elastic group through its generations (rules
//! EN-1..EN-3 in `chorus::elastic_nccl`), with the fake communicator: ranks
//! are tasks of this process on an in-process store.

use std::sync::Arc;
use std::time::Duration;

use chorus::elastic_nccl::ElasticNccl;
use chorus::store::{HashStore, Store};
use chorus::{DType, ElasticGroup, ReduceOp};
use chorus_actors::nccl::fake::{FakeBackend, FakeBuffer};
use chorus_actors::nccl::{NcclGroupConfig, NcclOp};

mod common;
use common::{elastic_options as options, within};

fn nccl_config() -> NcclGroupConfig {
    NcclGroupConfig {
        timeout: Duration::from_secs(1),
        ..NcclGroupConfig::default()
    }
}

/// An NCCL all-reduce (sum) of four ones on the current generation.
async fn all_reduce_ones(nccl: &ElasticNccl<FakeBackend>) -> Result<Vec<f32>, chorus_actors::nccl::NcclOpError> {
    let ones: Vec<u8> = bytemuck::cast_slice(&[1.0f32; 4]).to_vec();
    let group = nccl.current();
    let out = group
        .run(
            NcclOp::all_reduce(DType::Float32, 4, ReduceOp::Sum),
            None,
            FakeBuffer::from_host(ones),
        )
        .await?;
    Ok(bytemuck::cast_slice(&out.to_host()).to_vec())
}

async fn start(store: &Arc<dyn Store>, backend: &FakeBackend, rank: usize) -> (ElasticGroup, ElasticNccl<FakeBackend>) {
    let group = ElasticGroup::init_with(options(store, rank, 3).elastic_world(2, 3), |e| {
        eprintln!("gave up: {e}")
    })
    .await
    .unwrap();
    let nccl = ElasticNccl::attach(&group, backend.clone(), nccl_config(), Duration::from_secs(10))
        .await
        .unwrap();
    (group, nccl)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn en2_en3_a_dead_rank_aborts_nccl_and_the_survivors_get_a_new_communicator() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let backend = FakeBackend::new();
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            let (store, backend) = (store.clone(), backend.clone());
            tokio::spawn(async move {
                let (group, nccl) = start(&store, &backend, rank).await;
                assert_eq!(all_reduce_ones(&nccl).await.unwrap(), vec![3.0; 4]);
                // Until every rank has seen its all-reduce complete: a death
                // before that fails a collective the others have not
                // finished waiting for, as it would on a GPU.
                store.add("first all-reduce seen", 1).await.unwrap();
                if rank == 2 {
                    while store.add("first all-reduce seen", 0).await.unwrap() < 3 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    // Rank 2 dies: its links are lost (a cut, SV-14).
                    let links: Vec<_> = (0..3).filter_map(|r| group.current().link(r).cloned()).collect();
                    drop(nccl);
                    drop(group);
                    for link in links {
                        link.cut("rank 2 died");
                    }
                    return None;
                }
                let next = nccl.next_generation(0).await.unwrap();
                assert_eq!((next.generation(), next.world()), (1, 2));
                let sum = all_reduce_ones(&nccl).await.unwrap();
                drop(next);
                drop(nccl);
                group.destroy().await.unwrap();
                Some(sum)
            })
        })
        .collect();
    for task in ranks {
        if let Some(sum) = within(30, "the elastic NCCL group", task).await.unwrap() {
            assert_eq!(sum, vec![2.0; 4], "generation 1 has two ranks");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn en1_a_hung_nccl_collective_restarts_the_whole_group() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let backend = FakeBackend::new();
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            let (store, backend) = (store.clone(), backend.clone());
            tokio::spawn(async move {
                let (group, nccl) = start(&store, &backend, rank).await;
                if rank != 2 {
                    // Rank 2 never joins this all-reduce: it hangs on 0 and 1
                    // until the NCCL watchdog aborts it (1 s).
                    let hung = all_reduce_ones(&nccl).await;
                    assert!(hung.is_err(), "rank {rank}: {hung:?}");
                }
                // Everyone, rank 2 included, moves to generation 1 with all three ranks.
                let next = nccl.next_generation(0).await.unwrap();
                assert_eq!((next.generation(), next.world()), (1, 3));
                assert_eq!(group.generation(), 1);
                let sum = all_reduce_ones(&nccl).await.unwrap();
                drop(next);
                drop(nccl);
                group.destroy().await.unwrap();
                sum
            })
        })
        .collect();
    for task in ranks {
        let sum = within(30, "the restarted NCCL group", task).await.unwrap();
        assert_eq!(sum, vec![3.0; 4]);
    }
}
