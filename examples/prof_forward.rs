//! Times a forward pass of a model file with and without autograd tracking.
fn main() {
    use candle_core::{DType, Device, Tensor};
    let path = std::env::args().nth(1).expect("a .gguf path");
    let (loaded, _) =
        main_ppo::model::gguf::load(std::path::Path::new(&path), DType::F32, &Device::Cpu, true)
            .unwrap();
    let m = loaded.model.no_grad();
    for (b, t) in [(1usize, 160usize), (16, 160)] {
        let ids = Tensor::zeros((b, t), DType::U32, &Device::Cpu).unwrap();
        let pos = Tensor::arange(0u32, t as u32, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap()
            .repeat((b, 1))
            .unwrap();
        let mask = Tensor::ones((b, t), DType::U32, &Device::Cpu).unwrap();
        let t0 = std::time::Instant::now();
        let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
        let _ = h.sum_all().unwrap().to_scalar::<f32>().unwrap();
        println!("no_grad b={b} t={t}: {:.2} s", t0.elapsed().as_secs_f64());
    }
}
